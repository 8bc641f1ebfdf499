"""The lane rates the CPU-expert cost model is fed, as the engine measures them (engine.tiers.lanes.measure_rates),
on a store of Qwen3-30B-A3B-shaped experts (hidden 2048, FFN 768, bf16, the GPU kernels' rows order: what a CUDA
machine's CPU lane computes from).

  python3 bench/cpu_lane_rates.py --out bench/results/cpu_lane_rates.json [--threads 1 2] [--device cuda]

Per round and torch thread count: a fresh TieredExperts over the store (device cpu with a slot tier, so the
measurement is the provider's own code path), its measured disk rate (O_DIRECT batch into the RAM tier), CPU
rate (one-token expert FFN on the lane thread, median of 5) and slot-copy rate (on --device cpu a host memcpy,
labelled so; with --device cuda the page-locked RAM tier -> GPU slot copy over PCIe). Rounds interleave the thread counts; medians are
reported with the load average beside each round. The bound it feeds: one decode pick on the CPU lane costs
record_bytes / cpu rate, so the table prints the expert time at each rate too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="cpu (a slot tier in host memory) or cuda (real PCIe copies)")
    args = ap.parse_args()
    from engine.store import manifest as mf
    from engine.tiers.tiered import TieredExperts

    with tempfile.TemporaryDirectory(dir=REPO / ".kiln" if (REPO / ".kiln").is_dir() else None) as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "engine", "synth", "--out", str(tmp / "model"), "--store",
                        str(tmp / "store"), "--layers", "1", "--experts", str(args.experts), "--top-k", "8",
                        "--vocab", "512", "--device", "cpu"], check=True, capture_output=True, cwd=REPO)
        store = tmp / "store"
        m = mf.load(store)
        rounds = []
        for r in range(args.rounds):
            for threads in args.threads:
                torch.set_num_threads(threads)
                prov = TieredExperts(m, store, device=args.device, gpu_slots=2, ram_slots=args.experts, readers=4,
                                     cpu_experts="auto")
                try:
                    rates = prov.rates
                finally:
                    prov.close()
                row = {"round": r, "threads": threads, "disk_gbps": rates.disk / 1e9, "cpu_gbps": rates.cpu / 1e9,
                       "copy_gbps": rates.pcie / 1e9, "load": os.getloadavg()[0]}
                rounds.append(row)
                print(f"round {r} threads {threads}: disk {row['disk_gbps']:.2f} GB/s, cpu {row['cpu_gbps']:.2f} GB/s, "
                      f"copy {row['copy_gbps']:.2f} GB/s (load {row['load']:.2f})", flush=True)
    summary = {}
    print(f"\n{'threads':>7} {'disk GB/s':>10} {'cpu GB/s':>9} {'copy GB/s':>10} {'cpu ms/expert':>14}")
    for threads in args.threads:
        rows = [x for x in rounds if x["threads"] == threads]
        med = {k: statistics.median(x[k] for x in rows) for k in ("disk_gbps", "cpu_gbps", "copy_gbps")}
        med["cpu_ms_per_expert"] = m.layout.payload_bytes / (med["cpu_gbps"] * 1e9) * 1e3
        summary[str(threads)] = med
        print(f"{threads:>7} {med['disk_gbps']:>10.2f} {med['cpu_gbps']:>9.2f} {med['copy_gbps']:>10.2f} "
              f"{med['cpu_ms_per_expert']:>14.2f}")
    out = {"bench": "cpu_lane_rates", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": os.uname().nodename,
           "cpus": len(os.sched_getaffinity(0)), "record_bytes": m.record_bytes, "payload_bytes": m.layout.payload_bytes,
           "shape": {"hidden": m.layout.hidden, "intermediate": m.layout.intermediate, "dtype": str(m.layout.dtype),
                     "order": m.layout.order},
           "device": args.device,
           "copy": "RAM tier -> GPU slot over PCIe" if args.device.startswith("cuda") else "host memcpy (no GPU), not PCIe", "medians": summary, "rounds": rounds}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp_out = Path(args.out).with_suffix(".tmp")
    tmp_out.write_text(json.dumps(out, indent=1) + "\n")
    tmp_out.rename(args.out)


if __name__ == "__main__":
    main()

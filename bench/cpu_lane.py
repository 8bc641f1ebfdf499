"""The CPU expert lane's kernel (engine.kernels.lane.moe) beside the host's DRAM read rate, in one run.

  python -m bench.cpu_lane --out bench/results/<date>-cpu-lane.json [--cpus 1-15] [--rounds 3]

Per round, for the lane's thread counts 1 and N (N = the --cpus given, each team thread pinned to one of them):
  dram  — engine.kernels.lane.read_bandwidth: the same pinned team streaming a buffer of --dram-mib (≫ the
          last-level cache, printed) with 64-byte loads;
  lane  — GB/s of int4 expert records (payload bytes) the kernel computes through at 1, 8 and 32 picks a layer call
          (1 and 8: one token's picks; 32: four tokens × 8), every pick a distinct record of a pool of --pool-mib
          (≫ the LLC), records of the Qwen3-30B-A3B expert shape (hidden 2048, FFN 768), in both int4 orders: rows
          (what a CUDA machine's RAM tier holds, the H200's lane) and cols (a CPU store's); and ggml (--orders
          ...,ggml): a GGUF's records as a Q4_K_M holds them, Q4_K gate and up, Q6_K down (random blocks); and
          ggml-int8: the same records with x rounded to 8 bits as llama.cpp rounds it for each type (Q8_K for the
          K-quants: `--cpu-activations int8`, llama.cpp's way: integer dot products).
And once, for reference, what the lane ran before: quant_ffn per pick (rows: dequantize + F.linear in fp32; cols:
native int4_ffn one expert at a time; ggml: native ggml_ffn one expert at a time, holding the GIL) on N torch
threads, 8 picks. Every figure prints with the lane/DRAM ratio
beside the target (>= 0.5) and the host load of its round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import engine.cli  # noqa: F401  (GOMP_SPINCOUNT as engine serve sets it, before torch loads libgomp: bench.lane_call_overhead)
import torch

from bench.harness import host_load, log, table, write_result
from engine.kernels import lane, native
from engine.kernels.quant_cpu import quant_ffn
from engine.quant.records import QuantLayout

TARGET = 0.5
PICKS = {1: 1, 8: 1, 32: 4}          # picks a call -> tokens they are spread over (8 picks each)


def cpu_list(spec: str | None) -> list[int]:
    """"1-15,17" → [1, ..., 15, 17]; None → the CPUs this process may use."""
    if not spec:
        return sorted(os.sched_getaffinity(0))
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


GGML_TYPES = ("q4_k", "q4_k", "q6_k")          # a Q4_K_M's expert record: gate, up, down


def ggml_layout(hidden: int, intermediate: int) -> QuantLayout:
    from engine.gguf_tensors import expert_layout
    return expert_layout(hidden, intermediate, [GGML_TYPES]).quantized


def pool(layout: QuantLayout, mib: int, distinct: int = 4) -> torch.Tensor:
    """[n, record_bytes] uint8: `distinct` real records (random weights packed, or for ggml: random blocks of its
    types) repeated to fill `mib`."""
    gen = torch.Generator().manual_seed(0)
    h, i = layout.hidden, layout.intermediate
    shapes = ((i, h), (i, h), (h, i))
    if layout.mixed:
        from engine.gguf_tensors import expert_record
        from tests.engine.test_ggml_types import random_blocks     # blocks with finite scales and the edge cases
        recs = [expert_record(layout, *((t, random_blocks(t, o, k, gen)) for t, (o, k) in zip(GGML_TYPES, shapes)))
                for _ in range(distinct)]
    else:
        recs = [layout.pack(*(torch.randn(o, k, generator=gen) * 0.02 for o, k in shapes)) for _ in range(distinct)]
    n = max(64, mib * (1 << 20) // layout.record_bytes)
    out = torch.empty(n, layout.record_bytes, dtype=torch.uint8)
    for j in range(n):
        out[j] = recs[j % distinct]
    return out


def lane_gbps(layout: QuantLayout, recs: torch.Tensor, picks: int, team: lane.Team, min_s: float = 0.4) -> float:
    """GB/s of record payload through lane.moe at `picks` distinct records a call, cycling through the pool."""
    tokens = PICKS[picks]
    x = torch.randn(tokens, layout.hidden)
    toks = [j // (picks // tokens) for j in range(picks)]
    n = recs.shape[0]
    base, stride = recs.data_ptr(), layout.record_bytes
    w = [1.0 / picks] * picks
    j, calls, t0 = 0, 0, time.perf_counter()
    while True:
        addrs = [base + ((j + k) % n) * stride for k in range(picks)]
        lane.moe(x, toks, addrs, w, layout, team)
        j, calls = (j + picks) % n, calls + 1
        dt = time.perf_counter() - t0
        if dt >= min_s and calls * picks >= n // 2:
            return calls * picks * layout.payload_bytes / dt / 1e9


def before_gbps(layout: QuantLayout, recs: torch.Tensor, threads: int, picks: int = 8, reps: int = 3) -> float:
    """The lane's old path, quant_ffn one pick at a time on `threads` torch threads (median of reps)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(1, layout.hidden)
        times = []
        for r in range(reps):
            t0 = time.perf_counter()
            for k in range(picks):
                quant_ffn(layout, recs[(r * picks + k) % recs.shape[0]], x)
            times.append(time.perf_counter() - t0)
        return picks * layout.payload_bytes / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(prev)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpus", help="the lane's CPUs, e.g. 1-15 (default: every CPU this process may use)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dram-mib", type=int, default=None, help="DRAM buffer (default: max(1024, 8 x the LLC))")
    ap.add_argument("--pool-mib", type=int, default=1024, help="expert records streamed (≫ the LLC)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--orders", default="rows,cols")
    args = ap.parse_args()
    if lane.lib() is None:
        raise SystemExit("bench.cpu_lane: the native kernels did not build here (no g++, or not x86-64)")
    cpus = cpu_list(args.cpus)
    llc = lane.llc_bytes()
    dram_mib = args.dram_mib or max(1024, 8 * (llc or 0) >> 20)
    teams = {1: lane.Team(1, cpus[:1]), len(cpus): lane.Team(len(cpus), cpus)}
    layouts = {o: ggml_layout(args.hidden, args.intermediate) if o.startswith("ggml") else
               QuantLayout(args.hidden, args.intermediate, "int4", o) for o in args.orders.split(",")}
    # ggml-int8: the library's process-wide activation mode around that order's calls (native.allow sets it back)
    mode = lambda o: native.allow(True, int8_activations=o == "ggml-int8")               # noqa: E731
    log(f"lane kernels: {lane.isa()}; CPUs {cpus[0]}-{cpus[-1]} ({len(cpus)}); LLC {llc and llc >> 20} MiB; "
        f"DRAM buffer {dram_mib} MiB; record pool {args.pool_mib} MiB; load {host_load()['loadavg']}")
    pools: dict = {}
    for o, q in layouts.items():          # ggml-int8 reads ggml's records where both are measured
        pools[o] = pools["ggml"] if o == "ggml-int8" and "ggml" in pools else pool(q, args.pool_mib)
    worker = ThreadPoolExecutor(1, thread_name_prefix="lane-bench")    # the lane's own thread: its team's master
    run = lambda fn, *a: worker.submit(fn, *a).result()                # noqa: E731
    rounds = []
    for r in range(args.rounds):
        load0 = host_load()
        row: dict = {"round": r + 1}
        for n, team in teams.items():
            row[f"dram_t{n}"] = run(lambda: lane.read_bandwidth(dram_mib << 20, team, reps=3))["gbps"]
            for o, q in layouts.items():
                for p in PICKS:
                    with mode(o):
                        row[f"{o}_p{p}_t{n}"] = run(lane_gbps, q, pools[o], p, team)
        row["host"] = {"before": load0, "after": host_load()}
        log(f"round {r + 1}/{args.rounds}: load {row['host']['after']['loadavg']}, " +
            ", ".join(f"{k} {v:.2f}" for k, v in row.items() if isinstance(v, float)))
        rounds.append(row)
    n_max = len(cpus)
    before = {}
    for o, q in layouts.items():
        with mode(o):
            before[o] = run(before_gbps, q, pools[o], n_max)
    med = lambda k: round(statistics.median(x[k] for x in rounds), 3)                # noqa: E731
    rows, summary = [], {}
    for n in teams:
        dram = med(f"dram_t{n}")
        summary[f"dram_gbps_t{n}"] = dram
        for o in layouts:
            for p in PICKS:
                g = med(f"{o}_p{p}_t{n}")
                summary[f"{o}_p{p}_t{n}_gbps"] = g
                rows.append({"threads": n, "order": o, "picks": p, "lane GB/s": g, "DRAM GB/s": dram,
                             "lane/DRAM": round(g / dram, 3), f">= {TARGET}": "yes" if g / dram >= TARGET else "no"})
    print()
    text = table(rows, ["threads", "order", "picks", "lane GB/s", "DRAM GB/s", "lane/DRAM", f">= {TARGET}"])
    for o, g in before.items():
        log(f"before (quant_ffn per pick, {n_max} torch threads, 8 picks, {o}): {g:.3f} GB/s")
    best = {o: max(summary[f"{o}_p{p}_t{n_max}_gbps"] for p in PICKS) for o in layouts}
    doc = {"bench": "cpu_lane", "isa": lane.isa(), "cpus": cpus, "llc_bytes": llc, "dram_buffer_mib": dram_mib,
           "pool_mib": args.pool_mib, "shape": {"hidden": args.hidden, "intermediate": args.intermediate},
           "payload_bytes": {o: q.payload_bytes for o, q in layouts.items()}, "target_lane_over_dram": TARGET,
           "medians": summary, "before_gbps_8_picks": {o: round(g, 3) for o, g in before.items()},
           "lane_over_dram_best": {o: round(best[o] / summary[f"dram_gbps_t{n_max}"], 3) for o in layouts},
           "table": text, "rounds": rounds}
    write_result(args.out, doc)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()

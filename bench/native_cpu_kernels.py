"""The engine's native CPU GEMVs (engine.kernels.native) against the torch kernels they replace, at the demo's shapes.

  python -m bench.native_cpu_kernels --out bench/results/native_cpu_kernels.json

One token, streamed as a decode step reads them: each path runs over COPIES distinct copies of its matrix (more
bytes than the shared L3 keeps for one process), so the figure is the stream's, not a cache's. Per matrix:
  int4 (q|k|v 960x576, o 576x576, an expert's gate|up 3072x576 and down 576x1536): torch's
    _weight_int4pack_mm_for_cpu (bf16 x) against native.int4pack_gemv on the same int4pack operand;
  the vocabulary (49152x576, SmolLM2's tied embedding): float32 x @ W^T (the engine's Projection before)
    against native.q8_gemv on its Q8_0 codes and scales.
1 and 2 threads, rounds interleaved path by path, medians, the load average beside each round; the max error
of the native result against torch's (relative to the largest output).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.harness import interleaved, write_result
from engine.kernels import native
from engine.quant.records import int4pack_operands, to_int4pack

INT4 = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
        "down 576x1536": (576, 1536)}
VOCAB = (49152, 576)


def timed(fn, copies: list, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        for c in copies:
            fn(*c)
    return (time.perf_counter() - t0) / (calls * len(copies)) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copies-mb", type=float, default=120.0, help="bytes streamed per pass, MB")
    args = ap.parse_args()
    assert native.lib() is not None and native.int4_ok(), "the native kernels did not build here"
    gen = torch.Generator().manual_seed(0)
    rows = {}
    for name, (out, inp) in INT4.items():
        buf = to_int4pack(torch.randint(0, 16, (out, inp), generator=gen), torch.randn(out, inp // 32, 2, generator=gen))
        n = max(1, int(args.copies_mb * 1e6 / buf.numel()))
        ops = [int4pack_operands(buf.clone(), out, inp, 32) for _ in range(n)]
        x = torch.randn(inp, generator=gen)
        xb = x.view(1, -1).to(torch.bfloat16)
        ref = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, *ops[0][:1], 32, ops[0][1]).float().view(-1)
        err = float((native.int4pack_gemv(x, *ops[0], 32) - ref).abs().max() / ref.abs().max())
        paths = {"torch int4 kernel (bf16 x)":
                 (lambda p, s, xb=xb: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, 32, s)),
                 "native int4pack_gemv": (lambda p, s, x=x: native.int4pack_gemv(x, p, s, 32))}
        rows[name] = {"bytes": buf.numel(), "copies": n, "max_rel_err_vs_torch": err, "paths": paths, "ops": ops}
    q = torch.randint(-127, 128, VOCAB, dtype=torch.int8, generator=gen)
    d = (torch.rand(VOCAB[0], VOCAB[1] // 32, generator=gen) * 0.01).half().float()
    w_t = (q.float().view(VOCAB[0], -1, 32) * d[..., None]).view(VOCAB).t().contiguous()
    n = max(1, int(args.copies_mb * 1e6 / (q.numel() + d.numel() * 4)))
    qs = [(q.clone(), d.clone()) for _ in range(n)]
    x = torch.randn(VOCAB[1], generator=gen)
    ref = x.view(1, -1) @ w_t
    err = float((native.q8_gemv(x, q, d) - ref.view(-1)).abs().max() / ref.abs().max())
    rows["vocabulary 49152x576"] = {
        "bytes": {"fp32": w_t.numel() * 4, "q8_0": q.numel() + d.numel() * 4}, "copies": n, "max_rel_err_vs_torch": err,
        "paths": {"float32 x @ W^T (Projection before)": (lambda *_: x.view(1, -1) @ w_t),
                  "native q8_gemv (Q8_0 codes + fp32 scales)": (lambda qq, dd: native.q8_gemv(x, qq, dd))},
        "ops": qs}
    result = {"what": __doc__.strip().splitlines()[0], "date": time.strftime("%Y-%m-%d %H:%M"), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "rounds": args.rounds, "results": {}}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, r in rows.items():

            def one(p, fn, r=r):
                copies = r["ops"] if p.startswith(("native", "torch")) else [()]
                timed(fn, copies[:2], 3)                 # warm
                return round(timed(fn, copies, max(1, 60 // len(copies))), 1)
            rounds = interleaved({p: (lambda p=p, fn=fn: one(p, fn)) for p, fn in r["paths"].items()}, args.rounds,
                                 warmup=False)
            got = {p: [x[p] for x in rounds] for p in r["paths"]}
            loads = [x["host"]["loadavg"][0] if x["host"]["loadavg"] else None for x in rounds]
            med = {p: statistics.median(v) for p, v in got.items()}
            base, new = list(med.values())
            result["results"].setdefault(name, {"bytes": r["bytes"], "max_rel_err_vs_torch": r["max_rel_err_vs_torch"]})
            result["results"][name][f"{threads}_threads"] = {"us_rounds": got, "us_median": med,
                                                             "speedup": round(base / new, 2), "loadavg": loads}
            print(f"{threads} thr {name:22} " + "  ".join(f"{p}: {m:.1f} us" for p, m in med.items())
                  + f"  x{base / new:.2f}  load {loads}", flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()

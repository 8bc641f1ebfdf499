"""Which CPU kernel computes a quantized expert fastest, exactly enough (SmolLM2's expert: hidden 576, FFN 1536).

  python -m bench.quant_cpu_kernels --out bench/results/quant_cpu_kernels.json

One expert FFN (gate|up, SiLU, down) on 1 token (decode) and on 16 (a prefill chunk), 2 threads, each path
in interleaved rounds, medians, the load average printed beside each round:
  fp32_record           the engine's float path on a cols fp32 record (single_ffn): today's baseline
  dequant_per_call      a q4_1 record dequantized to fp32 on every call, then expert_ffn
  int4pack_bf16         torch.ops.aten._weight_int4pack_mm_for_cpu with bf16 activations on the cols record
                        (engine.kernels.quant_cpu.quant_ffn: what the engine serves 4-bit records with)
  int4pack_fp32         the same op with float32 activations and scales (torch's other dtype path)
  int8pack_bf16         torch.ops.aten._weight_int8pack_mm (bf16): per-output-channel scales only, so it cannot
                        read group-wise int8 or q8_0 records; timed for the comparison alone
  q8_0_dequant_per_call a q8_0 record dequantized per call (what 8-bit records are served with)
Each path's max error against a plain dequantize-then-matmul of the same record (relative to its max).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import interleaved, write_result

REPO = Path(__file__).resolve().parent.parent

H, I = 576, 1536


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    import gguf
    from engine.experts import ExpertLayout, expert_ffn
    from engine.kernels.cpu import set_compute_threads, single_ffn
    from engine.kernels.quant_cpu import quant_ffn, quant_ffn_reference
    from engine.quant.records import QuantLayout, group_size, int4pack_operands
    threads = set_compute_threads(2)
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(I, H, generator=g) * 0.05, torch.randn(I, H, generator=g) * 0.05,
            torch.randn(H, I, generator=g) * 0.05]
    q41 = [torch.from_numpy(gguf.quantize(m.numpy(), gguf.GGMLQuantizationType.Q4_1)) for m in mats]
    q80 = [torch.from_numpy(gguf.quantize(m.numpy(), gguf.GGMLQuantizationType.Q8_0)) for m in mats]
    rows41, cols41 = QuantLayout(H, I, "q4_1", "rows"), QuantLayout(H, I, "q4_1", "cols")
    rec_rows, rec_cols = rows41.pack_blocks(*q41), cols41.pack_blocks(*q41)
    rows80 = QuantLayout(H, I, "q8_0", "rows")
    rec80 = rows80.pack_blocks(*q80)
    deq = rows41.dequantize(rec_rows)
    flay = ExpertLayout(H, I, torch.float32, "cols")
    frec = flay.pack(*deq)
    fviews = flay.views(frec)
    # fp32 operands of torch's int4 op: the same codes, scales in float32
    gu_pk, gu_sz = int4pack_operands(cols41.region(rec_cols, "gate_up"), 2 * I, H, group_size(H, "q4_1"))
    d_pk, d_sz = int4pack_operands(cols41.region(rec_cols, "down"), H, I, group_size(I, "q4_1"))
    gu_sz32, d_sz32 = gu_sz.float(), d_sz.float()
    w8 = [torch.cat([m for m in deq[:2]]), deq[2]]
    s8 = [w.abs().amax(1) / 127 for w in w8]
    q8 = [torch.round(w / s[:, None]).to(torch.int8) for w, s in zip(w8, s8)]
    w8deq = [q.float() * s[:, None] for q, s in zip(q8, s8)]

    def int4_fp32(x):
        gu = torch.ops.aten._weight_int4pack_mm_for_cpu(x, gu_pk, 32, gu_sz32)
        h = F.silu(gu[:, :I]) * gu[:, I:]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(h, d_pk, 32, d_sz32)

    def int8_bf16(x):
        gu = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q8[0], s8[0].to(torch.bfloat16)).float()
        h = F.silu(gu[:, :I]) * gu[:, I:]
        return torch.ops.aten._weight_int8pack_mm(h.to(torch.bfloat16), q8[1], s8[1].to(torch.bfloat16)).float()

    def fp32_record(x):
        y = single_ffn(x, fviews) if x.shape[0] == 1 else None
        return y if y is not None else expert_ffn(x, *fviews)

    paths = {
        "fp32_record": fp32_record,
        "dequant_per_call": lambda x: expert_ffn(x, *rows41.dequantize(rec_rows)),
        "int4pack_bf16": lambda x: quant_ffn(cols41, rec_cols, x),
        "int4pack_fp32": int4_fp32,
        "int8pack_bf16": int8_bf16,
        "q8_0_dequant_per_call": lambda x: quant_ffn(rows80, rec80, x),
    }
    refs = {"fp32_record": lambda x: expert_ffn(x, *deq), "dequant_per_call": lambda x: expert_ffn(x, *deq),
            "int4pack_bf16": lambda x: quant_ffn_reference(cols41, rec_cols, x),
            "int4pack_fp32": lambda x: quant_ffn_reference(cols41, rec_cols, x).float(),
            "int8pack_bf16": lambda x: expert_ffn(x, w8deq[0][:I], w8deq[0][I:], w8deq[1]),
            "q8_0_dequant_per_call": lambda x: quant_ffn_reference(rows80, rec80, x)}
    record_bytes = {"fp32_record": flay.record_bytes, "dequant_per_call": rows41.record_bytes,
                    "int4pack_bf16": cols41.record_bytes, "int4pack_fp32": cols41.record_bytes,
                    "int8pack_bf16": 3 * H * I + 2 * (2 * I + H) * 2, "q8_0_dequant_per_call": rows80.record_bytes}
    out = {"what": __doc__.strip().splitlines()[0], "threads": threads, "torch": torch.__version__,
           "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": "),
           "date": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds, "calls_per_round": args.calls, "cases": {}}
    for m in (1, 16):
        x = torch.randn(m, H, generator=g)

        def per_call_us(fn, x=x):
            fn(x)                                        # warm: this path's operands back in cache
            t = time.perf_counter()
            for _ in range(args.calls):
                fn(x)
            return (time.perf_counter() - t) / args.calls * 1e6
        rounds = interleaved({name: (lambda fn=fn: per_call_us(fn)) for name, fn in paths.items()}, args.rounds,
                             warmup=False)
        times = {k: [r[k] for r in rounds] for k in paths}
        loads = [r["host"]["loadavg"][0] if r["host"]["loadavg"] else None for r in rounds]
        case = {}
        for name, fn in paths.items():
            got, want = fn(x).float(), refs[name](x).float()
            case[name] = {"median_us": round(statistics.median(times[name]), 1),
                          "rounds_us": [round(v, 1) for v in times[name]], "record_bytes": record_bytes[name],
                          "max_err_rel": float((got - want).abs().max() / want.abs().max())}
        base = case["fp32_record"]["median_us"]
        for c in case.values():
            c["speedup_vs_fp32_record"] = round(base / c["median_us"], 2)
        out["cases"][f"tokens_{m}"] = {"load_avg_per_round": loads, "paths": case}
        print(f"\n{m} token(s), 2 threads, load {loads}")
        print(f"{'path':24} {'median us':>10} {'x fp32':>7} {'record MB':>9} {'max err':>9}")
        for name, c in case.items():
            print(f"{name:24} {c['median_us']:10.1f} {c['speedup_vs_fp32_record']:7.2f} "
                  f"{c['record_bytes'] / 1e6:9.2f} {c['max_err_rel']:9.1e}")
    write_result(Path(args.out), out)


if __name__ == "__main__":
    main()

"""Quantized vs bf16 expert kernels on one GPU: the routed-expert part of a 24-layer Qwen3-30B-A3B-shaped
slice (hidden 2048, expert FFN 768, 128 experts, top-8), every expert resident in one slot arena.

  python -m bench.quant_gpu_kernels --out bench/results/quant_gpu_kernels.json

decode   one token through 24 MoE layers (8 random experts each, distinct slots per layer so nothing is
         served from L2 twice): bf16 with the engine's own GEMV kernels (engine.gpu.moe_kernels.slot_moe)
         against the quantized GEMV kernels (engine.kernels.quant_triton) on int8 / int4 / q8_0 / q4_1 /
         q4_k records. Printed beside each: record bytes read per token, the effective HBM rate, and the
         HBM bound (a device-to-device copy's rate measured in the same run).
prefill  512 tokens through one layer: bf16 per-expert GEMMs (the engine's prefill path) against the
         quantized grouped GEMM.
exact    each quantized kernel against the plain dequantize-then-matmul of the same records (bf16).
This is the kernels' figure, not a whole-model decode: attention, norms and the router are not in it.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.harness import write_result

REPO = Path(__file__).resolve().parent.parent

H, I, E, K, LAYERS = 2048, 768, 128, 8, 24


def random_records(lay, n: int, dev) -> torch.Tensor:
    """n valid records: int8/int4 quantized from random bf16 weights; GGUF schemes random blocks with
    small finite fp16 scales (any codes are valid)."""
    from engine.quant.records import GGUF_BLOCK
    out = torch.empty(n, lay.record_bytes, dtype=torch.uint8, device=dev)
    if lay.scheme in ("int8", "int4"):
        for j in range(n):
            g = torch.Generator(device=dev).manual_seed(j)
            mats = [torch.randn(s, generator=g, device=dev) * 0.02 for s in ((I, H), (I, H), (H, I))]
            out[j] = lay.pack(*[m.cpu() for m in mats]).to(dev) if j < 4 else out[j % 4]
        return out
    per, size = GGUF_BLOCK[lay.scheme]
    out.random_(0, 256)
    for name, (off, nbytes, o, inp) in lay.regions.items():
        blocks = out[:, off:off + nbytes].view(n, -1, size)
        nd = 4 if lay.scheme in ("q4_1", "q4_k") else 2          # d (and m / dmin): fp16 at the block's start
        blocks[:, :, :nd] = (torch.rand(n, blocks.shape[1], nd // 2, device=dev) * 1e-3).to(torch.float16).view(torch.uint8)
    return out


def timed(fn, iters: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]      # microseconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    from engine.experts import ExpertLayout
    from engine.kernels.triton_moe import slot_moe, slot_moe_reference
    from engine.kernels.quant_triton import quant_grouped_moe, quant_moe_reference, quant_slot_moe
    from engine.quant.records import QuantLayout

    dev = torch.device("cuda")
    torch.manual_seed(0)
    # The HBM bound: a device-to-device copy of 4 GiB.
    a = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    t = statistics.median(timed(lambda i: b.copy_(a), 5))
    hbm_gbps = 2 * a.numel() / (t * 1e-6) / 1e9
    del a, b
    torch.cuda.empty_cache()

    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(1, K, device=dev), -1).to(torch.bfloat16)
    slots = [torch.stack([torch.randperm(E, device=dev)[:K] + l * E for l in range(LAYERS)])
             for _ in range(args.iters)]                                     # [LAYERS, K] per iteration
    xp = torch.randn(512, H, device=dev, dtype=torch.bfloat16)
    wp = torch.softmax(torch.randn(512, K, device=dev), -1).to(torch.bfloat16)
    sp = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(512)])

    results = {}
    schemes = ["bf16", "int8", "int4", "q8_0", "q4_1", "q4_k"]
    for scheme in schemes:
        if scheme == "bf16":
            lay = ExpertLayout(H, I, torch.bfloat16)
            arena = (torch.randn(LAYERS * E, lay.record_elems, device=dev) * 0.02).to(torch.bfloat16)
            dec = lambda s: slot_moe(x, arena, s[None], w, lay)                   # noqa: E731
            pre = lambda: slot_moe_reference(xp, arena, sp, wp, lay)               # noqa: E731
            rec_bytes = lay.record_bytes
            err = None
        else:
            lay = QuantLayout(H, I, scheme, "rows")
            arena = random_records(lay, LAYERS * E, dev)
            dec = lambda s, lay=lay, arena=arena: quant_slot_moe(x, arena, s[None], w, lay)            # noqa: E731
            pre = lambda lay=lay, arena=arena: quant_grouped_moe(xp, arena, sp, wp, lay)              # noqa: E731
            rec_bytes = lay.record_bytes
            s0 = slots[0][0][None]
            ref = quant_moe_reference(x, arena, s0, w, lay).float()
            got_d = quant_slot_moe(x, arena, s0, w, lay).float()
            ref_p = quant_moe_reference(xp[:64], arena, sp[:64], wp[:64], lay).float()
            got_p = quant_grouped_moe(xp[:64], arena, sp[:64], wp[:64], lay).float()
            err = {"gemv_rel": float((got_d - ref).norm() / ref.norm()),
                   "grouped_gemm_rel": float((got_p - ref_p).norm() / ref_p.norm())}

        def token(i):
            for l in range(LAYERS):
                dec(slots[i][l])
        token(0)
        torch.cuda.synchronize()
        us = statistics.median(timed(token, args.iters))
        pre()
        torch.cuda.synchronize()
        pre_us = statistics.median(timed(lambda i: pre(), 5))
        moved = LAYERS * K * rec_bytes
        results[scheme] = {"record_bytes": rec_bytes, "decode_us_per_token": round(us, 1),
                           "decode_tok_s": round(1e6 / us, 1), "bytes_per_token": moved,
                           "effective_gbps": round(moved / (us * 1e-6) / 1e9, 1),
                           "hbm_bound_tok_s": round(hbm_gbps * 1e9 / moved, 1),
                           "prefill_512_us_per_layer": round(pre_us, 1), "exactness": err}
        del arena
        torch.cuda.empty_cache()
    base = results["bf16"]
    for r in results.values():
        r["decode_speedup_vs_bf16"] = round(base["decode_us_per_token"] / r["decode_us_per_token"], 2)
        r["prefill_speedup_vs_bf16"] = round(base["prefill_512_us_per_layer"] / r["prefill_512_us_per_layer"], 2)
    out = {"what": __doc__.strip().splitlines()[0], "device": torch.cuda.get_device_name(dev),
           "capability": ".".join(map(str, torch.cuda.get_device_capability(dev))), "torch": torch.__version__,
           "shape": {"hidden": H, "intermediate": I, "experts": E, "top_k": K, "layers": LAYERS},
           "hbm_copy_gbps": round(hbm_gbps, 1), "iters": args.iters, "date": time.strftime("%Y-%m-%d"),
           "results": results}
    write_result(Path(args.out), out)
    print(f"{'scheme':7} {'rec MB':>7} {'dec us/tok':>10} {'tok/s':>7} {'x bf16':>6} {'GB/s':>6} {'bound':>7} "
          f"{'pre512 us':>9} {'x bf16':>6}  exact")
    for s, r in results.items():
        print(f"{s:7} {r['record_bytes'] / 1e6:7.2f} {r['decode_us_per_token']:10.1f} {r['decode_tok_s']:7.1f} "
              f"{r['decode_speedup_vs_bf16']:6.2f} {r['effective_gbps']:6.0f} {r['hbm_bound_tok_s']:7.0f} "
              f"{r['prefill_512_us_per_layer']:9.0f} {r['prefill_speedup_vs_bf16']:6.2f}  {r['exactness']}")
    print(f"HBM copy {hbm_gbps:.0f} GB/s")


if __name__ == "__main__":
    main()

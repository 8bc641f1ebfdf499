"""The GGUF kernels on one GPU at Qwen3-30B-A3B's shapes (hidden 2048, expert FFN 768, 128 experts, top-8; q|k|v
5120 x 2048, o 2048 x 4096, head 151936 x 2048), with Q4_K_M's types (experts Q4_K gate/up and Q6_K down; attention
Q4_K; head Q6_K), random blocks with small finite scales:

  python -m bench.gguf_gpu_kernels --out $OUT/gguf-gpu-kernels.json            # the H200: ~1 minute with compiles
  TRITON_INTERPRET=1 python -m bench.gguf_gpu_kernels --tiny --out /tmp/k.json  # the CPU dry run (no figures)

decode   one token through --layers MoE layers (8 experts each, distinct slots, nothing twice from L2): the typed
         GEMVs (engine.kernels.quant_triton: each layer's types compiled in) under a few tiles, the per-element
         ggml: path they replace (each type read from the record's header), and Kiln's int4 records (the 1.15x
         llama-bench path) on records of the same shape; µs a token, record bytes a token, GB/s.
prefill  --prefill tokens through one layer: the typed grouped GEMM against int4's.
dense    one row (decode) and --prefill rows through q|k|v, o and the head: engine.kernels.ggml_linear on the blocks
         against F.linear on bf16 copies (what the GPU held before).
Each typed kernel is also checked against the plain dequantize-then-matmul on a few picks (rel. error printed).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.harness import log, write_result

H, I, E, K = 2048, 768, 128, 8
# Where each type keeps its fp16 scales: random bytes there could be inf or NaN.
FP16_AT = {"q4_k": (0, 2), "q6_k": (208,), "q8_0": (0,), "q5_0": (0,)}
GEMV_TRIES = [{}, dict(pairs=False), dict(q4_k_up_chunk=1024), dict(up_chunk=512, up_warps=4, pairs=False),
              dict(block_h=16, down_warps=4), dict(block_h=32, down_warps=8)]


def blocks(t: str, rows: int, inp: int, dev, n: int = 1) -> torch.Tensor:
    """uint8 [n, rows·row bytes] of GGML type t: random codes, small fp16 scales."""
    from engine.quant import ggml
    g = ggml.ggml_type(t)
    nb = rows * inp // g.block
    out = torch.randint(0, 256, (n, nb, g.size), dtype=torch.uint8, device=dev)
    for at in FP16_AT[t]:
        out[:, :, at:at + 2] = (torch.rand(n, nb, 1, device=dev) * 1e-3).to(torch.float16).view(torch.uint8)
    return out.view(n, -1)


def timed(fn, iters: int, dev) -> float:
    """Median seconds of fn() over iters (after one warm-up call)."""
    fn()
    if dev.type != "cuda":
        t = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return sorted(t)[len(t) // 2]
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[iters // 2] / 1e3


def rel(a, b) -> float:
    return round(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)), 5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run: 256-wide shapes, 2 layers, 64 tokens")
    args = ap.parse_args()
    global H, I, E
    from engine.kernels import quant_triton as qt
    from engine.kernels.ggml_linear import ggml_linear
    from engine.quant import ggml
    from engine.quant.records import QuantLayout, mixed_scheme
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dense_shapes = {"qkv q4_k": ("q4_k", 5120, 2048), "o q4_k": ("q4_k", 2048, 4096), "head q6_k": ("q6_k", 151936, 2048)}
    if args.tiny:
        H, I, E, args.layers, args.prefill, args.iters = 256, 256, 8, 2, 64, 2
        dense_shapes = {k: (t, 256, 256) for k, (t, _, _) in dense_shapes.items()}
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    types = ("q4_k", "q4_k", "q6_k")
    lay = QuantLayout(H, I, mixed_scheme(types))
    n = args.layers * E
    arena = torch.zeros(n, lay.record_bytes, dtype=torch.uint8, device=dev)
    arena[:, :64] = torch.tensor(list(qt_header(types)), dtype=torch.uint8, device=dev)
    for name, t in zip(("gate", "up", "down"), types):
        off, size, o, inp = lay.regions[name]
        arena[:, off:off + size] = blocks(t, o, inp, dev, n)
    i4 = QuantLayout(H, I, "int4")
    a4 = torch.randint(0, 256, (n, i4.record_bytes), dtype=torch.uint8, device=dev)
    for name in ("gate", "up", "down"):             # int4's bf16 (s, z) pairs after the codes: small finite values
        off, size, o, inp = i4.regions[name]
        ng = o * (inp // 32) * 2
        a4[:, off + o * inp // 2: off + size] = (torch.rand(n, ng, device=dev) * 1e-3).to(torch.bfloat16).view(torch.uint8)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(1, H, generator=gen, device=dev)).to(dt)
    picks = [torch.randperm(E, generator=gen, device=dev)[:K].view(1, K) for _ in range(args.layers)]
    w = torch.full((1, K), 1.0 / K, device=dev)
    rec_bytes = sum(ggml.matrix_bytes(t, o, inp) for t, (_, _, o, inp) in zip(types, lay.regions.values()))
    out: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "shape": dict(H=H, I=I, E=E, K=K),
                 "layers": args.layers, "types": types, "decode": {}, "prefill": {}, "dense": {}, "exact": {}}

    def decode(fn):
        def step():
            for layer in range(args.layers):
                fn(picks[layer], layer * E)
        s = timed(step, args.iters, dev)
        return {"us_per_token": round(s * 1e6, 1), "gbps": round(args.layers * K * rec_bytes / s / 1e9, 1)}

    for tries in GEMV_TRIES:
        key = "typed " + (",".join(f"{k}={v}" for k, v in tries.items()) or "default")
        try:
            out["decode"][key] = decode(lambda s, o: qt.quant_slot_moe(x, arena, s, w, lay, slot_offset=o, types=types,
                                                                        typed=tries))
        except Exception as e:          # one tile failing must not lose the others
            out["decode"][key] = {"error": f"{type(e).__name__}: {str(e)[-500:]}"}
        log(key, out["decode"][key])
    out["decode"]["per-element ggml: path"] = decode(lambda s, o: qt.quant_slot_moe(x, arena, s, w, lay, slot_offset=o))
    out["decode"]["int4 records"] = decode(lambda s, o: qt.quant_slot_moe(x, a4, s, w, i4, slot_offset=o))
    log("per-element:", out["decode"]["per-element ggml: path"], "int4:", out["decode"]["int4 records"])
    ref = qt.quant_moe_reference(x.float(), arena, picks[0], w, lay)
    out["exact"]["typed gemv"] = rel(qt.quant_slot_moe(x.float(), arena, picks[0], w, lay, types=types), ref)
    write_result(args.out, out)                  # after each part: a capped call keeps what was measured

    xs = torch.randn(args.prefill, H, generator=gen, device=dev).to(dt)
    ids = torch.stack([torch.randperm(E, generator=gen, device=dev)[:K] for _ in range(args.prefill)])
    wp = torch.full((args.prefill, K), 1.0 / K, device=dev)
    for key, fn in (("typed grouped gemm", lambda: qt.quant_grouped_moe(xs, arena, ids, wp, lay, types=types)),
                    ("int4 grouped gemm", lambda: qt.quant_grouped_moe(xs, a4, ids, wp, i4))):
        try:
            s = timed(fn, max(3, args.iters // 4), dev)
            out["prefill"][key] = {"ms_per_layer": round(s * 1e3, 3), "tokens_per_s_one_layer": round(args.prefill / s)}
        except Exception as e:
            out["prefill"][key] = {"error": f"{type(e).__name__}: {str(e)[-500:]}"}
        log(key, out["prefill"][key])
    few = slice(0, 16)
    out["exact"]["typed grouped gemm"] = rel(qt.quant_grouped_moe(xs[few].float(), arena, ids[few], wp[few], lay,
                                                                  types=types),
                                             qt.quant_moe_reference(xs[few].float(), arena, ids[few], wp[few], lay))
    write_result(args.out, out)

    for key, (t, o, inp) in dense_shapes.items():
        b = blocks(t, o, inp, dev)[0]
        w32 = ggml.dequantize(t, b.cpu(), o, inp).to(dev)
        wf = w32.to(dt)
        r = {}
        for rows in (1, args.prefill):
            xr = torch.randn(rows, inp, generator=gen, device=dev).to(dt)
            r[f"blocks {rows} rows us"] = round(timed(lambda: ggml_linear(xr, b, t, o), args.iters, dev) * 1e6, 1)
            r[f"bf16 {rows} rows us"] = round(timed(lambda: F.linear(xr, wf), args.iters, dev) * 1e6, 1)
            xe = xr[:rows if rows == 1 else 16].float()          # the GEMV's rows, then the GEMM's (fp32: ieee)
            r[f"exact {rows} rows"] = rel(ggml_linear(xe, b, t, o), xe @ w32.t())
        del w32
        r["blocks_gbps_1_row"] = round(b.numel() / (r["blocks 1 rows us"] * 1e-6) / 1e9, 1)
        r["bf16_gbps_1_row"] = round(wf.numel() * 2 / (r["bf16 1 rows us"] * 1e-6) / 1e9, 1)
        out["dense"][key] = r
        log(key, r)
        del wf
        write_result(args.out, out)
    write_result(args.out, out)
    log(f"wrote {args.out}")


def qt_header(types) -> bytes:
    from engine.quant.records import header_bytes
    return header_bytes(types)


if __name__ == "__main__":
    main()

"""Per-op GPU time of one CUDA decode layer (Qwen3-30B-A3B shapes), and the expert GEMV kernels' tile choices.

  python3 bench/probes/decode_kernels.py --out bench/results/<date>-h200-decode-kernels.json

Each op is captured REPS times into one CUDA graph (each repetition on other experts' records, so the expert
reads come from HBM, not L2) and the graph replayed; µs per op = replay time / REPS. That is the op's GPU
time plus the graph's per-kernel gap — what a graph-captured decode step pays for it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


from engine.experts import ExpertLayout
from engine.kernels import triton_decode as td
from engine.kernels.quant_triton import quant_slot_moe
from engine.kernels.triton_moe import slot_moe

H, I, E, K, NH, NKV, HD, V = 2048, 768, 128, 8, 32, 4, 128, 151936
REPS = 40


def timed(fn_for_rep, reps: int = REPS, rounds: int = 5) -> float:
    """µs per call: reps calls captured in one graph, replayed `rounds` times, median."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for r in range(3):
            fn_for_rep(r)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(reps):
            fn_for_rep(r)
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return round(sorted(times)[len(times) // 2], 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g, device=dev) * 0.02).to(bf)  # noqa: E731
    res: dict = {"gpu": torch.cuda.get_device_name(), "reps_per_graph": REPS, "ops_us": {}, "moe_us": {}}
    ops = res["ops_us"]
    for b in (1, 4):
        x = rnd(b, H)
        wqkv, wo, wr, wl = rnd((NH + 2 * NKV) * HD, H), rnd(H, NH * HD), rnd(E, H), rnd(V, H)
        ops[f"b{b}_qkv_linear"] = timed(lambda r: F.linear(x, wqkv))
        xo = rnd(b, NH * HD)
        ops[f"b{b}_o_linear"] = timed(lambda r: F.linear(xo, wo))
        ops[f"b{b}_router_linear"] = timed(lambda r: F.linear(x, wr))
        ops[f"b{b}_lm_head"] = timed(lambda r: F.linear(x, wl), reps=8)
        w = torch.ones(H, dtype=bf, device=dev)
        ops[f"b{b}_add_rms_norm"] = timed(lambda r: td.add_rms_norm(x.clone(), x, w, 1e-6))
        ops[f"b{b}_clone_only"] = timed(lambda r: x.clone())
        cos, sin = torch.ones(9000, HD, dtype=bf, device=dev), torch.zeros(9000, HD, dtype=bf, device=dev)
        kc = torch.zeros(4, 9000, NKV, HD, dtype=bf, device=dev)
        vc = torch.zeros_like(kc)
        qkv = rnd(b, (NH + 2 * NKV) * HD)
        qn = torch.ones(HD, dtype=bf, device=dev)
        slots = torch.arange(b, device=dev)
        for kv in (256, 8192):
            pos = torch.full((b,), kv - 1, device=dev)
            ops[f"b{b}_qk_rope_kv"] = timed(lambda r: td.qk_rope_kv(qkv, qn, qn, cos, sin, pos, slots, kc, vc,
                                                                     num_heads=NH, num_kv_heads=NKV, head_dim=HD,
                                                                     eps=1e-6))
            q = rnd(b, NH, HD)
            ops[f"b{b}_attention_kv{kv}"] = timed(lambda r: td.decode_attention(q, kc, vc, slots, pos, kv,
                                                                                  scale=HD ** -0.5))
        lg = rnd(b, E)
        ops[f"b{b}_softmax_topk"] = timed(lambda r: td.softmax_topk(lg, K, True, bf))

    # expert GEMVs: bf16 tiles, int4 spans, over an arena too large for L2 (other experts each repetition)
    n_rec = 512
    lay = ExpertLayout(H, I, bf)
    arena = rnd(n_rec, lay.record_elems)
    q4 = ExpertLayout(H, I, torch.uint8, "rows", "int4")
    arena4 = torch.randint(0, 255, (n_rec, q4.record_bytes), generator=g, device=dev, dtype=torch.uint8)
    # valid scales: overwrite the int4 scale/zero regions with small bf16 values
    for name, (off, size, o, n) in q4.quantized.regions.items():
        codes = o * n // 2
        arena4[:, off + codes:off + size] = (torch.rand(n_rec, (size - codes) // 2, generator=g, device=dev) * 0.01
                                             ).to(bf).view(torch.uint8).view(n_rec, -1)
    moe = res["moe_us"]
    for b in (1, 4):
        x = rnd(b, H)
        wts = torch.full((b, K), 1.0 / K, dtype=bf, device=dev)
        sl = [torch.randint(0, n_rec, (b, K), generator=g, device=dev) for _ in range(REPS)]
        bf16_cfgs = {"bi4_gu2048_bh16_dc256_w4": dict(block_i=4, gate_up_cols=2048, block_h=16, down_cols=256, warps=4)}
        for name, kw in bf16_cfgs.items():
            try:
                moe[f"b{b}_bf16_{name}"] = timed(lambda r, kw=kw: slot_moe(x, arena, sl[r], wts, lay, **kw))
            except Exception as e:  # a config that does not compile is a row, not a failed probe
                moe[f"b{b}_bf16_{name}"] = f"error: {str(e)[-200:]}"
    # int4: groups a load (max_span) and warps at the default tile (8 rows / 32 rows), then the tile sizes at the
    # best of those, then 4 streams for the best few; the engine's default is the first row. (2026-12-03 also swept
    # an [rows, groups, bytes] load tile and masked spans past a matrix's groups: both slower, both removed.)
    sl1 = [torch.randint(0, n_rec, (1, K), generator=g, device=dev) for _ in range(REPS)]
    sl4 = [torch.randint(0, n_rec, (4, K), generator=g, device=dev) for _ in range(REPS)]
    x1, x4 = rnd(1, H), rnd(4, H)
    w1, w4 = (torch.full((b, K), 1.0 / K, dtype=bf, device=dev) for b in (1, 4))

    def int4(b, kw):
        x, sl, wts = (x1, sl1, w1) if b == 1 else (x4, sl4, w4)
        try:
            return timed(lambda r: quant_slot_moe(x, arena4, sl[r], wts, q4.quantized, **kw))
        except Exception as e:  # a config that does not compile is a row, not a failed probe
            return f"error: {str(e)[-200:]}"

    def name(kw):
        return "_".join(f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in kw.items())

    int4_rows: dict = {}
    default = dict(block_i=8, block_h=32, max_span=64, warps=2)
    forms = [dict(default, max_span=ms, warps=wp) for ms in (16, 64) for wp in (2, 4, 8)]
    for kw in [default] + [f for f in forms if f != default]:
        int4_rows[name(kw)] = (kw, int4(1, kw))
    ok = lambda rows: sorted(((v, kw) for kw, v in rows.values() if isinstance(v, float)), key=lambda r: r[0])  # noqa: E731
    best = ok(int4_rows)[0][1]
    for bi, bh in ((4, 16), (4, 32), (8, 16), (8, 64), (16, 32), (16, 64), (32, 64)):
        kw = dict(best, block_i=bi, block_h=bh)
        int4_rows.setdefault(name(kw), (kw, int4(1, kw)))
    for k_, (kw, v) in int4_rows.items():
        moe[f"b1_int4_{k_}"] = v
    top = [kw for _, kw in ok(int4_rows)[:4]]
    for kw in [default] + [t for t in top if t != default]:
        moe[f"b4_int4_{name(kw)}"] = int4(4, kw)
    res["int4_default"] = name(default)
    res["int4_best_b1"] = {"config": top[0], "us": ok(int4_rows)[0][0]}
    rec_bytes = {"bf16": lay.record_bytes, "int4": q4.record_bytes}
    res["expert_bytes_per_pick"] = rec_bytes
    res["hbm_us_per_layer_at_4_2_TBps"] = {k: round(K * v / 4.2e6, 2) for k, v in rec_bytes.items()}
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    for k, v in {**ops, **moe}.items():
        print(f"{k:48s} {v}")


if __name__ == "__main__":
    main()

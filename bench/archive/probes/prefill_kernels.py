"""Where a CUDA prefill's time goes (Qwen3-30B-A3B shapes), and the quantized grouped GEMM's tile choices.

  python3 bench/probes/prefill_kernels.py --work /tmp/pk --out bench/results/<date>-h200-prefill-kernels.json

1. The expert step of one MoE layer at prefill shapes (128, 512 and 2048 tokens, top-8 of 128, routing drawn
   uniformly) on a synthetic int4 store's records: the grouped GEMM as it was (weights unpacked element by element,
   16-row tiles) beside the tile-wise unpacking (_weights_tile) at its defaults and, at 2048 tokens, over tile
   heights, weight tiles and warps; and the bf16 store's per-expert GEMM loop (the bf16 prefill path) at the same
   shapes. Each figure: median of 7 timed calls after 2 warm-ups, CUDA-event timed, the host's launch work
   included (a prefill pays it).
2. F.scaled_dot_product_attention's first calls with a new shape: torch's backend choice, without cuDNN's, and as
   the engine calls it; each beside the dense-mask math kernel's output.
3. A 4-layer model of the same shapes: an 8000-token prompt prefilled in chunks of 512 and 2048 tokens as the
   scheduler does, twice (the first pass meets every attention shape anew), int4 and bf16; a torch.profiler table of
   one 2048-token int4 chunk.
4. (--parts new-lengths) a fresh process's int4 model meeting prompts of lengths it has not seen: first pass
   against second (a recompile or a per-shape plan shows as the difference).
Earlier forms, their results kept: -kernels-1.json (the int4 tile sweep at 128 and 512 tokens; 512-token chunks),
-kernels-2.json (the sweep at 2048; chunks of 512/2048/4096 with torch's attention backends and without cuDNN's).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch


from engine.kernels import quant_triton as qt
from engine.kernels.triton_moe import slot_moe_reference
from engine.loader import load_model
from engine.store import manifest as mf
from engine.synth import synthesize
from engine.tiers.resident import ResidentExperts

E, K = 128, 8


def timed_ms(fn, reps: int = 7) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return round(sorted(times)[len(times) // 2], 3)


def routing(t: int, gen: torch.Generator, dev) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]).to(dev)
    w = torch.softmax(torch.randn(t, K, generator=gen), -1).to(torch.bfloat16).to(dev)
    return ids, w


def kernel_sweep(store4: Path, store16: Path, dev) -> dict:
    out: dict = {"int4": [], "bf16_per_expert_loop": []}
    p4 = ResidentExperts.from_store(store4, dev)
    lay4 = mf.load(store4).layout.quantized
    arena4 = p4.arena[:E]
    gen = torch.Generator().manual_seed(0)
    hdim = lay4.hidden
    for t in (128, 512, 2048):
        x = torch.randn(t, hdim, generator=gen).to(torch.bfloat16).to(dev)
        ids, w = routing(t, gen, dev)
        ref = qt.quant_moe_reference(x, arena4, ids, w, lay4).float()
        rows = []

        def one(label, **kw):
            got = qt.quant_grouped_moe(x, arena4, ids, w, lay4, **kw).float()
            err = float((got - ref).norm() / ref.norm())
            ms = timed_ms(lambda: qt.quant_grouped_moe(x, arena4, ids, w, lay4, **kw))
            row = {"tokens": t, "label": label, **kw, "ms": ms, "rel_err": round(err, 5)}
            rows.append(row)
            print(json.dumps(row), flush=True)

        one("as it was", vec=False, block_m=16, block_n=64, block_k=64, warps=4, stages=3)
        one("defaults")
        if t == 2048:             # 128 pairs a slot: how tall a tile pays
            for most, (bn, bk), warps in itertools.product((32, 64, 128), ((64, 128), (128, 64), (128, 128)), (4, 8)):
                one("tile-wise", most_m=most, block_n=bn, block_k=bk, warps=warps)
        out["int4"] += rows
    del p4, arena4
    torch.cuda.empty_cache()
    p16 = ResidentExperts.from_store(store16, dev)
    lay16 = mf.load(store16).layout
    for t in (128, 512, 2048):
        x = torch.randn(t, hdim, generator=gen).to(torch.bfloat16).to(dev)
        ids, w = routing(t, gen, dev)
        ms = timed_ms(lambda: slot_moe_reference(x, p16.arena, ids, w, lay16, ids))
        row = {"tokens": t, "ms": ms}
        out["bf16_per_expert_loop"].append(row)
        print("bf16 per-expert loop", json.dumps(row), flush=True)
    del p16
    torch.cuda.empty_cache()
    return out


def sdpa_first_calls(dev) -> list[dict]:
    """ms of F.scaled_dot_product_attention at prefill shapes (32 query heads, 4 KV heads, 128 wide) on its first
    call with a shape and the two after: torch's backend choice (cuDNN's on the H200), without cuDNN, and as the
    engine calls it (engine.models.common.CUDA_ATTENTION, a later chunk's mask as causal_lower_right); each
    output's largest difference from the dense-mask math kernel's."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from engine.models.common import CUDA_ATTENTION
    rows = []
    for n, backend in enumerate(("default", "no_cudnn", "engine")):
        for t, kv in ((300 + n, None), (512, 1536 + 7 * n)):
            kv = kv or t
            q = torch.randn(1, 32, t, 128, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, 4, kv, 128, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            dense = (torch.arange(kv, device=dev) <= torch.arange(kv - t, kv, device=dev)[:, None]) if kv > t else None
            with sdpa_kernel([SDPBackend.MATH]):
                want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, is_causal=dense is None, enable_gqa=True)
            if backend == "engine":
                mask, ctx = (causal_lower_right(t, kv) if kv > t else None), sdpa_kernel(CUDA_ATTENTION)
            else:
                usable = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
                mask, ctx = dense, sdpa_kernel(usable + [SDPBackend.CUDNN_ATTENTION] * (backend == "default"))
            times = []
            with ctx:
                for _ in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                         enable_gqa=True)
                    torch.cuda.synchronize()
                    times.append(round((time.perf_counter() - t0) * 1000, 3))
            row = {"backend": backend, "q_tokens": t, "kv_len": kv, "masked": kv > t, "ms_calls_1_2_3": times,
                   "max_abs_diff_vs_math": float((got.float() - want.float()).abs().max())}
            rows.append(row)
            print("sdpa", json.dumps(row), flush=True)
    return rows


def model_prefill(model_dir: Path, store: Path, dev, label: str, chunks=(512, 2048), profile: bool = False) -> dict:
    """An 8000-token prompt prefilled in chunks as the scheduler does: ms for the whole prompt on its first pass
    (every attention shape new) and its second (the same shapes again), per chunk size."""
    m = load_model(model_dir, store_dir=store, device=dev, max_context=8704, max_batch=1, experts="resident",
                   cuda_graphs=False)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, m.cfg.vocab_size, (8000,), generator=gen)
    res: dict = {"label": label, "runs": []}
    with torch.inference_mode():
        m.prefill(ids[:64], 0)                          # warm-up: compiles, allocator
        for chunk in chunks:
            m.prefill(ids[:chunk], 0)                   # the GEMM's tiles for this chunk compiled
        torch.cuda.synchronize()
        for chunk in chunks:
            passes = []
            for _ in range(2):
                t0 = time.perf_counter()
                for start in range(0, len(ids), chunk):
                    m.prefill(ids[start:start + chunk], 0, start=start)
                torch.cuda.synchronize()
                passes.append(round((time.perf_counter() - t0) * 1000, 1))
            row = {"chunk": chunk, "ms_8000_first_pass": passes[0], "ms_8000_second_pass": passes[1]}
            res["runs"].append(row)
            print(label, json.dumps(row), flush=True)
        if profile:
            from torch.profiler import ProfilerActivity, profile as prof_
            with prof_(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                m.prefill(ids[4096:4096 + 2048], 0, start=4096)
                torch.cuda.synchronize()
            res["profile_by_cuda"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                                               max_name_column_width=50)
            print(res["profile_by_cuda"], flush=True)
    del m
    torch.cuda.empty_cache()
    return res


def new_lengths(model_dir: Path, store: Path, dev) -> list[dict]:
    """A fresh process's int4 model: prompts of lengths it has not met, each prefilled twice in the scheduler's
    alone chunks (4 x 512): ms of the first pass and the second. A first pass much slower than the second is a
    compile or a plan built for a new shape (a chunk of 2,011 tokens: 16,088 pairs, not a multiple of 16)."""
    from engine.engine_config import EngineConfig
    from engine.scheduler import ALONE_CHUNKS
    chunk = ALONE_CHUNKS * EngineConfig.chunk_size
    m = load_model(model_dir, store_dir=store, device=dev, max_context=8704, max_batch=1, experts="resident",
                   cuda_graphs=False)
    ids = torch.randint(0, m.cfg.vocab_size, (8192,), generator=torch.Generator().manual_seed(4))
    rows = []
    with torch.inference_mode():
        for n in (8192, 8155, 5001, 777):
            passes = []
            for _ in range(2):
                t0 = time.perf_counter()
                for start in range(0, n, chunk):
                    m.prefill(ids[start:min(start + chunk, n)], 0, start=start)
                torch.cuda.synchronize()
                passes.append(round((time.perf_counter() - t0) * 1000, 1))
            rows.append({"tokens": n, "ms_first_pass": passes[0], "ms_second_pass": passes[1]})
            print("new length", json.dumps(rows[-1]), flush=True)
    del m
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--parts", default="kernels,sdpa,model", help="of kernels, sdpa, model, new-lengths")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    dev = torch.device("cuda")
    work = Path(args.work)
    t0 = time.perf_counter()
    for name, quant in (("", None), ("-int4", "int4")):
        if not (work / f"store{name}" / mf.MANIFEST).exists():
            synthesize(work / f"model{name}", work / f"store{name}", num_hidden_layers=args.layers,
                       **({"quant": quant} if quant else {}))
    result: dict = {"command": " ".join(["python3"] + sys.argv), "gpu": torch.cuda.get_device_name(0),
                    "synth_s": round(time.perf_counter() - t0, 1)}
    if "new-lengths" in parts:        # first: the process has compiled nothing yet
        result["new_lengths"] = new_lengths(work / "model-int4", work / "store-int4", dev)
    if "kernels" in parts:
        result["kernels"] = kernel_sweep(work / "store-int4", work / "store", dev)
    if "sdpa" in parts:
        result["sdpa"] = sdpa_first_calls(dev)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if "model" in parts:
        result["model"] = [model_prefill(work / "model-int4", work / "store-int4", dev, "int4", profile=True),
                           model_prefill(work / "model", work / "store", dev, "bf16")]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

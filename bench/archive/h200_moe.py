"""Kiln's engine on one H200 against its peers, same checkpoint, same run (issue 7).

  python3 bench/h200_moe.py --work /tmp/kiln-bench --out bench/results/<date>-h200.json

1. Measures this machine's lanes: HBM (device copy), PCIe (pinned host→device in record-sized
   pieces), disk (O_DIRECT random record reads), DRAM (one-thread host copy).
2. Synthesizes a Qwen3-30B-A3B-shaped checkpoint (hidden 2048, 128 experts, top-8, FFN 768, 32/4
   heads, head dim 128, vocab 151936, bf16) with as many layers as the disk holds beside its store.
3. runs.engine_all_gpu     every expert resident; CUDA-graph decode at 1 and 4 streams; 8k prefill.
   runs.engine_offload     a 24 GB card's budget: GPU expert slots = 24 GiB − non-expert weights − KV
                           − workspace; a 16 GiB page-locked RAM tier; the rest read from the store
                           with O_DIRECT. Tier fractions, bytes per token per lane, and bound_tps from
                           this run's own bandwidths (ANCHORS.md's lane bound).
   runs.engine_offload_uniform the same, routing replaced by a uniform trace (labelled): the cache's worst case.
   runs.engine_offload_skewed  the same, routing replaced by a Zipf trace with reuse (labelled).
   runs.transformers_all_gpu   transformers' Qwen3MoeForCausalLM, all on the GPU.
   runs.accelerate_offload     the same model with device_map from accelerate under the same 24 GiB.
4. Exactness: engine vs transformers bf16 logits on one prompt; offload vs resident greedy tokens.
5. A projection for the full 48 layers with a 64 GiB RAM tier from this run's per-layer costs.
Prints a table last; writes everything to --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

from bench.harness import measure_lanes
from engine.experts.provider import ExpertProvider
from engine.measure.peer import CARD_BYTES, RAM_TIER, WORKSPACE
from engine.tiers.resident import ResidentExperts
from engine.tiers.tiered import TieredExperts
from engine.loader import load_model
from engine.store import manifest as mf
from engine.store.odirect import aligned_buffer, open_direct, pread_full
from engine.synth import QWEN3_30B_A3B, synth_config, synthesize
from engine.tiers.cache import ExpertCache, make_policy

GIB = 1 << 30
DEV = torch.device("cuda")


def log(*a):
    print(*a, flush=True)


def sync():
    torch.cuda.synchronize()


# ------------------------------------------------------------------ lanes

# ------------------------------------------------------------------ engine runs

def non_expert_bytes(model_dir: Path) -> int:
    return (model_dir / "model.safetensors").stat().st_size


def engine_prefill(model, n_tokens: int, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.prefill(ids[:256], 0)           # warm (kernels, allocator)
        sync()
        t0 = time.perf_counter()
        model.prefill(ids, 0)
        sync()
    dt = time.perf_counter() - t0
    return {"prefill_tokens": n_tokens, "prefill_s": round(dt, 3), "prefill_tps": round(n_tokens / dt, 1)}


def prompts(batch: int, length: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (length,), generator=g) for _ in range(batch)]


def engine_decode_graph(model, batch: int, steps: int, vocab: int, prompt_len: int = 128) -> dict:
    """model.decode_step as the server runs it: replayed from the model's own CUDA graphs (greedy)."""
    assert model.graphs is not None, "the model decodes eagerly: its provider is not graph-capturable"
    return engine_decode_eager(model, batch, steps, vocab, prompt_len, warm=8)


def engine_decode_eager(model, batch: int, steps: int, vocab: int, prompt_len: int = 128, warm: int = 16,
                        counters=None, sample: bool = False) -> dict:
    """Eager decode (any provider); counters() is sampled over the timed window only, when given.
    sample=True draws tokens (seeded) instead of greedy: greedy decoding of random weights falls into
    repeating one token, whose routing repeats too — a cache's best case, not the uniform worst case."""
    gen = torch.Generator(device=model.device).manual_seed(11)
    ps = prompts(batch, prompt_len, vocab)
    slots = list(range(batch))
    with torch.inference_mode():
        nxt = [int(model.prefill(p, s).argmax()) for s, p in zip(slots, ps)]
        out = [[t] for t in nxt]
        t0 = None
        for i in range(warm + steps):
            if i == warm:
                sync()
                c0 = counters() if counters else None
                t0 = time.perf_counter()
            logits = model.decode_step(nxt, slots, [prompt_len + i] * batch)
            if sample:
                nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen).view(-1).tolist()
            else:
                nxt = logits.argmax(-1).tolist()
            for o, t in zip(out, nxt):
                o.append(t)
        sync()
    dt = time.perf_counter() - t0
    res = {"streams": batch, "steps": steps, "warmup_steps": warm, "decode_s": round(dt, 4),
           "decode_tps": round(steps / dt, 1), "aggregate_tps": round(batch * steps / dt, 1), "tokens": out[0][:33]}
    if counters:
        res["window"] = (c0, counters())
    return res


class ZipfRouting:
    """A labelled synthetic routing trace: per layer a Zipf(s) law over a shuffled expert order, and
    each token keeps each of the previous token's experts with probability `reuse`."""

    def __init__(self, experts: int, top_k: int, s: float = 1.1, reuse: float = 0.5, seed: int = 3):
        self.e, self.k, self.s, self.reuse = experts, top_k, s, reuse
        self.rng = random.Random(seed)
        w = [1 / (i + 1) ** s for i in range(experts)]
        self.cum = [sum(w[:i + 1]) for i in range(experts)]
        self.order: dict[int, list[int]] = {}
        self.prev: dict[int, list[list[int]]] = {}

    def _draw(self, layer: int) -> int:
        order = self.order.setdefault(layer, self.rng.sample(range(self.e), self.e))
        x = self.rng.random() * self.cum[-1]
        lo, hi = 0, self.e - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.cum[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        return order[lo]

    def __call__(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        t = topk_ids.shape[0]
        prev = self.prev.get(layer, [[] for _ in range(t)])
        rows = []
        for i in range(t):
            keep = [e for e in (prev[i] if i < len(prev) else []) if self.rng.random() < self.reuse]
            row = list(dict.fromkeys(keep))[:self.k]
            while len(row) < self.k:
                e = self._draw(layer)
                if e not in row:
                    row.append(e)
            rows.append(row)
        self.prev[layer] = rows
        return torch.tensor(rows, dtype=topk_ids.dtype).to(topk_ids.device, non_blocking=True)


class UniformRouting:
    """A labelled synthetic trace: each token's top-k drawn uniformly without replacement — the
    cache's worst case, which random weights do not give (their router concentrates)."""

    def __init__(self, experts: int, top_k: int, seed: int = 4):
        self.e, self.k, self.rng = experts, top_k, random.Random(seed)

    def __call__(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        rows = [self.rng.sample(range(self.e), self.k) for _ in range(topk_ids.shape[0])]
        return torch.tensor(rows, dtype=topk_ids.dtype).to(topk_ids.device, non_blocking=True)


class RoutedBy(ExpertProvider):
    """Bench only: the tiered provider fed a labelled synthetic routing trace instead of the model's router.
    The trace is drawn on the host, so such a run decodes eagerly (not graph-capturable)."""

    graph_capturable = False

    def __init__(self, inner: TieredExperts, trace):
        self.inner, self.trace, self.layout = inner, trace, inner.layout
        self.predictor = None            # the model's router cannot predict a synthetic trace

    def forward(self, layer, x, topk_ids, topk_weights):
        return self.inner.forward(layer, x, self.trace(layer, topk_ids), topk_weights)

    def counters(self) -> dict:
        return self.inner.counters()

    def close(self) -> None:
        self.inner.close()


TRACES = {"zipf": ("zipf s=1.1 over experts, reuse 0.5 (synthetic trace, labelled)", ZipfRouting),
          "uniform": ("uniform top-k per token (synthetic trace, labelled)", UniformRouting)}


def offload_run(model_dir, store, m, budget, lanes, all_gpu_step_s, *, trace: str | None, steps: int, vocab: int,
                prefill_tokens: int) -> dict:
    prov = TieredExperts(m, store, device=DEV, gpu_slots=budget["gpu_slots"], ram_slots=budget["ram_slots"],
                         readers=16, policy="lru")
    top_k = json.loads((Path(model_dir) / "config.json").read_text())["num_experts_per_tok"]
    routed = RoutedBy(prov, TRACES[trace][1](m.experts_per_layer, top_k)) if trace else prov
    model = load_model(model_dir, provider=routed, device="cuda", dtype="bfloat16", max_context=prefill_tokens + 512,
                       max_batch=4)
    res: dict = {"routing": TRACES[trace][0] if trace
                 else "the model's own router (on random weights it may concentrate: see served_fraction)"}
    # warm the tiers with a few hundred tokens of decode, then measure
    greedy = engine_decode_eager(model, 1, 32, vocab, warm=0) if not trace else None
    engine_decode_eager(model, 1, 16, vocab, warm=48, sample=True)
    d1 = engine_decode_eager(model, 1, steps, vocab, warm=8, counters=prov.counters, sample=True)
    c0, c1 = d1.pop("window")
    picks = {k: c1["served"][k] - c0["served"][k] for k in c1["served"]}
    total_picks = sum(picks.values()) or 1
    tokens = steps                                      # the timed window's decode steps
    per_tok = {"pcie_bytes": (c1["pcie_bytes"] - c0["pcie_bytes"]) / tokens,
               "disk_bytes": (c1["store_read_bytes"] - c0["store_read_bytes"]) / tokens,
               "host_s": (c1["host_seconds"] - c0["host_seconds"]) / tokens}
    lanes_s = {"gpu": all_gpu_step_s,
               "pcie": per_tok["pcie_bytes"] / (lanes["pcie_h2d_pinned_gbps"] * 1e9),
               "disk": per_tok["disk_bytes"] / (lanes["disk_odirect_random_16t_gbps"] * 1e9),
               "cpu": 0.0}
    bound_tps = 1 / max(lanes_s.values())
    d4 = engine_decode_eager(model, 4, max(8, steps // 2), vocab, warm=8, sample=True)
    res.update({
        "decode_tps": d1["decode_tps"], "decode_tps_4_streams_aggregate": d4["aggregate_tps"],
        "decoding": "sampled (temperature 1, seeded) so routing follows the tokens; greedy tokens for exactness",
        "tokens": greedy["tokens"] if greedy else None,
        "served_fraction": {k: round(v / total_picks, 4) for k, v in picks.items()},
        "bytes_per_token": {"pcie": int(per_tok["pcie_bytes"]), "disk": int(per_tok["disk_bytes"]), "cpu": 0},
        "host_seconds_per_token": round(per_tok["host_s"], 5),
        "lane_seconds_per_token": {k: round(v, 6) for k, v in lanes_s.items()},
        "bound_tps": round(bound_tps, 1),
        "fraction_of_bound": round(d1["decode_tps"] / bound_tps, 3),
        "counters": c1,
    })
    if not trace:
        res.update(engine_prefill(model, prefill_tokens, vocab))
    prov.close()
    del model, prov
    gc.collect()
    torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------ peers

def hf_model(model_dir: Path, store: Path, device: str):
    """transformers' Qwen3MoeForCausalLM holding exactly the engine's weights (experts from the store)."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg_d = json.loads((model_dir / "config.json").read_text())
    cfg = Qwen3MoeConfig(**{k: v for k, v in cfg_d.items() if k not in ("architectures", "model_type")})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)            # allocate bf16 directly (a 30B-class fp32 copy would not fit)
    try:
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device)
    sd = load_file(str(model_dir / "model.safetensors"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected[:3]
    m = mf.load(store)
    lay, e = m.layout, m.experts_per_layer
    fd = open_direct(store / mf.DATA)
    buf = aligned_buffer(e * m.record_bytes)
    host = torch.frombuffer(buf, dtype=torch.bfloat16)[:e * lay.record_elems].view(e, lay.record_elems)
    try:
        for layer in m.moe_layers:
            pread_full(fd, memoryview(buf)[:e * m.record_bytes], m.record(layer, 0).offset)
            ex = model.model.layers[layer].mlp.experts
            n = lay.matrix_elems
            gate = host[:, :n].view(e, lay.intermediate, lay.hidden)
            up = host[:, n:2 * n].view(e, lay.intermediate, lay.hidden)
            down = host[:, 2 * n:3 * n].view(e, lay.hidden, lay.intermediate)
            ex.gate_up_proj.data.copy_(torch.cat([gate, up], dim=1))
            ex.down_proj.data.copy_(down)
    finally:
        os.close(fd)
    del host
    # rotary buffers were created on meta: recompute them on the target device
    for mod in model.modules():
        if hasattr(mod, "inv_freq") and hasattr(mod, "compute_default_rope_parameters"):
            inv, scale = mod.compute_default_rope_parameters(mod.config)
            mod.inv_freq = inv.to(device)
            mod.original_inv_freq = inv.clone().to(device)
            mod.attention_scaling = scale
    return model.eval()


def hf_decode(model, steps: int, vocab: int, device) -> dict:
    ids = prompts(1, 128, vocab)[0].view(1, -1).to(device)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False)
        sync()
        dt = time.perf_counter() - t0
    # generate's time includes the prompt's prefill; subtract it, measured alone
    with torch.inference_mode():
        sync()
        t1 = time.perf_counter()
        model(ids)
        sync()
        pre = time.perf_counter() - t1
    return {"decode_tps": round(steps / max(1e-9, dt - pre), 3), "steps": steps, "generate_s": round(dt, 3),
            "prefill_s": round(pre, 3), "tokens": out[0, 128:].tolist()[:33],
            "experts_implementation": getattr(model.config, "_experts_implementation", None)}


# ------------------------------------------------------------------ projection

def simulate_misses(layers: int, experts: int, top_k: int, gpu_slots: int, ram_slots: int, tokens: int,
                    skewed: bool) -> dict:
    """LRU over a routing trace: fraction of picks that miss the GPU tier, and that miss the RAM tier too."""
    gpu = ExpertCache("gpu", gpu_slots, make_policy("lru"))
    ram = ExpertCache("ram", ram_slots, make_policy("lru"))
    rng = random.Random(5)
    zipf = ZipfRouting(experts, top_k) if skewed else None
    gpu_miss = ram_miss = picks = 0
    for t in range(tokens):
        for layer in range(layers):
            row = zipf(layer, torch.zeros(1, top_k, dtype=torch.long))[0].tolist() if zipf else rng.sample(range(experts), top_k)
            for e in row:
                key = (layer, e)
                picks += 1
                if gpu.lookup(key) is None:
                    if t >= tokens // 2:
                        gpu_miss += 1
                    if ram.lookup(key) is None:
                        if t >= tokens // 2:
                            ram_miss += 1
                        ram.admit(key, pinned=set())
                    gpu.admit(key, pinned={(layer, x) for x in row})
    measured = picks / 2
    return {"gpu_miss": gpu_miss / measured, "store_miss": ram_miss / measured}


def project_48(cfg: dict, lanes: dict, per_layer_gpu_s: float, efficiency: float, record_bytes: int,
               kv_bytes_per_layer: int, skewed: bool) -> dict:
    layers, e, k = 48, cfg["num_experts"], cfg["num_experts_per_tok"]
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    non_expert = 2 * (2 * v * h + layers * (2 * q * h + 2 * kv * h + e * h))
    gpu_slots = (CARD_BYTES - non_expert - layers * kv_bytes_per_layer - WORKSPACE) // record_bytes
    ram_slots = 64 * GIB // record_bytes
    sim = simulate_misses(layers, e, k, gpu_slots, ram_slots, 300, skewed)
    picks = layers * k
    lanes_s = {"gpu": per_layer_gpu_s * layers,
               "pcie": sim["gpu_miss"] * picks * record_bytes / (lanes["pcie_h2d_pinned_gbps"] * 1e9),
               "disk": sim["store_miss"] * picks * record_bytes / (lanes["disk_odirect_random_16t_gbps"] * 1e9),
               "cpu": 0.0}
    bound = 1 / max(lanes_s.values())
    return {"layers": layers, "gpu_slots": int(gpu_slots), "ram_slots": int(ram_slots),
            "routing": "zipf s=1.1, reuse 0.5 (synthetic)" if skewed else "uniform",
            "gpu_miss_fraction": round(sim["gpu_miss"], 4), "store_miss_fraction": round(sim["store_miss"], 4),
            "lane_seconds_per_token": {k2: round(x, 6) for k2, x in lanes_s.items()},
            "bound_tps": round(bound, 1), "projected_tps": round(bound * efficiency, 1),
            "efficiency_used": round(efficiency, 3)}


# ------------------------------------------------------------------ main

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/kiln-bench")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / f"{date.today()}-h200.json"))
    ap.add_argument("--layers", type=int, default=0, help="0: as many as the disk holds (at most 48, at least 24)")
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--peer-steps", type=int, default=16)
    ap.add_argument("--accelerate-steps", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: peers,accelerate,offload,uniform,skewed")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"command": " ".join([Path(sys.executable).name] + sys.argv), "date": str(date.today()),
                    "runs": {}}
    t_start = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():                      # after every part: a run cut short still leaves what it measured
        result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
        out.write_text(json.dumps(result, indent=2) + "\n")

    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    import transformers
    result["machine"] = {"gpu": props.name, "nvidia_smi": smi, "sms": props.multi_processor_count,
                         "cpus": os.cpu_count(), "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
                         "disk_free_gb": round(shutil.disk_usage(work).free / 1e9, 1)}
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    result["versions"] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                          "transformers": transformers.__version__, "triton": tv}

    # --- checkpoint + store, sized to the disk
    cfg0 = synth_config()
    rec = 3 * cfg0["hidden_size"] * cfg0["moe_intermediate_size"] * 2
    per_layer = cfg0["num_experts"] * rec + 2 * (2 * 4096 * 2048 + 2 * 512 * 2048 + 128 * 2048)
    free = shutil.disk_usage(work).free - 4 * 1e9 - 2 * 151936 * 2048 * 2
    layers = args.layers or max(24, min(48, int(free // per_layer)))
    model_dir, store = work / "model", work / "store"
    log(f"synth: {layers} layers ({layers * cfg0['num_experts'] * rec / 1e9:.1f} GB of experts)")
    t0 = time.perf_counter()
    if not (store / mf.MANIFEST).exists() or mf.load(store).moe_layers != list(range(layers)):
        syn = synthesize(model_dir, store, num_hidden_layers=layers)
    else:
        syn = {"reused": True}
    syn["seconds"] = round(time.perf_counter() - t0, 1)
    result["checkpoint"] = {"shape": {**QWEN3_30B_A3B, "num_hidden_layers": layers}, "synth": syn}
    m = mf.load(store)
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg["vocab_size"]

    lanes = measure_lanes(store / mf.DATA, m.record_bytes, len(m.records))
    result["lanes"] = lanes
    save()
    log("lanes:", lanes)

    # --- engine, all on the GPU
    prov = ResidentExperts.from_store(store, DEV)
    model = load_model(model_dir, provider=prov, device="cuda", dtype="bfloat16", max_context=args.prefill + 512,
                       max_batch=4)
    ag = {"gpu_expert_bytes": prov.arena.numel() * 2}
    d1 = engine_decode_graph(model, 1, args.steps, vocab)
    d4 = engine_decode_graph(model, 4, args.steps, vocab)
    ag.update({"decode_tps": d1["decode_tps"], "decode_tps_4_streams_aggregate": d4["aggregate_tps"],
               "tokens": d1["tokens"], "cuda_graphs": True})
    graphs, model.graphs = model.graphs, None           # the same steps without graphs
    eager = engine_decode_eager(model, 1, 16, vocab, warm=4)
    model.graphs = graphs
    ag["decode_tps_eager"] = eager["decode_tps"]
    ag.update(engine_prefill(model, args.prefill, vocab))
    all_gpu_step_s = 1 / d1["decode_tps"]
    result["runs"]["engine_all_gpu"] = ag
    save()
    log("engine_all_gpu:", {k: v for k, v in ag.items() if k != "tokens"})

    # exactness prompt logits (engine side), before freeing
    probe_ids = prompts(1, 64, vocab)[0]
    with torch.inference_mode():
        eng_logits = model.prefill(probe_ids, 0, all_logits=True).float().cpu()
    kv_per_layer = 2 * 4 * (args.prefill + 512) * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    del model, prov
    gc.collect()
    torch.cuda.empty_cache()

    # --- engine under a 24 GB card's budget
    non_expert = non_expert_bytes(model_dir)
    gpu_slots = (CARD_BYTES - non_expert - layers * kv_per_layer - WORKSPACE) // m.record_bytes
    budget = {"card_bytes": CARD_BYTES, "non_expert_bytes": non_expert, "kv_cache_bytes": layers * kv_per_layer,
              "workspace_bytes": WORKSPACE, "gpu_slots": int(gpu_slots), "ram_tier_bytes": RAM_TIER,
              "ram_slots": RAM_TIER // m.record_bytes, "records": len(m.records), "record_bytes": m.record_bytes}
    result["budget"] = budget
    if "offload" not in skip:
        off = offload_run(model_dir, store, m, budget, lanes, all_gpu_step_s, trace=None, steps=args.steps,
                          vocab=vocab, prefill_tokens=args.prefill)
        result["runs"]["engine_offload"] = off
        save()
        log("engine_offload:", {k: v for k, v in off.items() if k not in ("tokens", "counters")})
        result["exactness"] = {"offload_vs_resident_greedy_tokens_equal": off["tokens"][:len(ag["tokens"])] == ag["tokens"][:len(off["tokens"])],
                               "compared_tokens": min(len(off["tokens"]), len(ag["tokens"]))}
    for name, trace in (("engine_offload_uniform", "uniform"), ("engine_offload_skewed", "zipf")):
        if trace in skip or (trace == "zipf" and "skewed" in skip):
            continue
        run = offload_run(model_dir, store, m, budget, lanes, all_gpu_step_s, trace=trace, steps=args.steps,
                          vocab=vocab, prefill_tokens=args.prefill)
        result["runs"][name] = run
        save()
        log(f"{name}:", {k: v for k, v in run.items() if k not in ("tokens", "counters")})

    # --- peers
    if "peers" not in skip:
        hf = hf_model(model_dir, store, "cuda")
        with torch.inference_mode():
            hf_logits = hf(probe_ids.view(1, -1).to(DEV)).logits[0].float().cpu()
        diff = (hf_logits - eng_logits)
        result.setdefault("exactness", {}).update({
            "prompt_tokens": 64,
            "logits_rel_l2": round(float(diff.norm() / hf_logits.norm()), 5),
            "logits_max_abs": round(float(diff.abs().max()), 4),
            "top1_agreement": round(float((hf_logits.argmax(-1) == eng_logits.argmax(-1)).float().mean()), 4)})
        tg = hf_decode(hf, args.peer_steps, vocab, DEV)
        result["runs"]["transformers_all_gpu"] = tg
        save()
        log("transformers_all_gpu:", {k: v for k, v in tg.items() if k != "tokens"})
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        if "accelerate" not in skip:
            from accelerate import dispatch_model, infer_auto_device_map
            hf = hf_model(model_dir, store, "cpu")
            dmap = infer_auto_device_map(hf, max_memory={0: CARD_BYTES - WORKSPACE, "cpu": 200 * GIB},
                                         no_split_module_classes=["Qwen3MoeDecoderLayer"])
            hf = dispatch_model(hf, device_map=dmap)
            on_cpu = sum(1 for v in dmap.values() if v == "cpu")
            ac = hf_decode(hf, args.accelerate_steps, vocab, DEV)
            ac.update({"max_memory_gpu_bytes": CARD_BYTES, "modules_on_cpu": on_cpu, "modules_total": len(dmap)})
            result["runs"]["accelerate_offload"] = ac
            log("accelerate_offload:", {k: v for k, v in ac.items() if k != "tokens"})
            del hf
            gc.collect()

    # --- targets, projection
    runs = result["runs"]
    t = {}
    if "transformers_all_gpu" in runs:
        t["engine_all_gpu_vs_transformers"] = round(runs["engine_all_gpu"]["decode_tps"] / runs["transformers_all_gpu"]["decode_tps"], 1)
    if "accelerate_offload" in runs and "engine_offload" in runs:
        t["engine_offload_vs_accelerate"] = round(runs["engine_offload"]["decode_tps"] / runs["accelerate_offload"]["decode_tps"], 1)
    if "engine_offload" in runs:
        t["engine_offload_fraction_of_bound"] = runs["engine_offload"]["fraction_of_bound"]
        # Project with the efficiency of a run a transfer lane actually bound (the uniform trace), else
        # the model-router run's.
        basis = runs.get("engine_offload_uniform") or runs["engine_offload"]
        eff = min(1.0, basis["fraction_of_bound"])
        result["projection_48_layers_64gib_ram"] = {
            "uniform": project_48(cfg, lanes, all_gpu_step_s / layers, eff, m.record_bytes, kv_per_layer // 1, False),
            "skewed": project_48(cfg, lanes, all_gpu_step_s / layers, eff, m.record_bytes, kv_per_layer // 1, True),
            "method": "lane bound from this run's bandwidths and per-layer GPU step time, LRU miss rates simulated "
                      "on the routing law, times the measured fraction of its own bound of the uniform-trace run "
                      "(else the model-router run)"}
    result["targets"] = {**t, "required": {"engine_all_gpu_vs_transformers": 20, "engine_offload_vs_accelerate": 50,
                                          "engine_offload_fraction_of_bound": 0.6}}
    save()

    log("\n| run | decode tok/s (1 stream) | 4 streams agg | prefill tok/s | bound tok/s |")
    log("|---|---|---|---|---|")
    for name, r in runs.items():
        log(f"| {name} | {r.get('decode_tps')} | {r.get('decode_tps_4_streams_aggregate', '')} | "
            f"{r.get('prefill_tps', '')} | {r.get('bound_tps', '')} |")
    log("targets:", json.dumps(result["targets"]))
    log("exactness:", json.dumps(result.get("exactness")))
    log("wrote", out)


if __name__ == "__main__":
    main()

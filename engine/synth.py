"""`engine synth`: a random Qwen3-MoE or GLM-5.3-Flash (glm5_next) checkpoint of a given shape, its routed experts written
straight into a packed store (no expert tensors in safetensors: at 30B scale that would double
the disk a benchmark needs). The store is built like pack-store's: staging dir, O_DIRECT writes,
re-read and hashed, manifest, then published by rename. Weights are N(0, std) from a seed, so a
run is reproducible; routing over random weights is close to uniform (the hardest case for a cache).
`quant` int8/int4: the same bf16 draws, quantized at write time (engine.quant.records), so a quantized
store of a seed is the quantization of that seed's bf16 store and serves the same checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.checkpoint import Checkpoint
from engine.errors import EngineError, Exit
from engine.experts.layout import ExpertLayout
from engine.glm5_next_config import Glm5Spec, tensor_shapes
from engine.store import manifest as mf
from engine.store.odirect import aligned_buffer, open_direct, probe, pwrite_full
from engine.store import model_manifest
from engine.store.pack import publish_store
from engine.store.verify import hash_records

# Qwen3-30B-A3B's shape (the benchmark model); every field overridable.
QWEN3_30B_A3B = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                     num_hidden_layers=48, intermediate_size=6144, rms_norm_eps=1e-6, max_position_embeddings=40960)


# GLM-5.3-Flash's shape (transformers' Glm5NextTextConfig defaults; the seed's store): 45 layers, the first 3 dense,
# then 42 MoE layers of 288 routed experts + 1 shared, top-8; KDA layers with a DSA layer every 4th. Written in the
# published flat form (first_k_dense_replace, linear_attn_config, mla_use_nope, model.layers.*); a --layers slice
# keeps the schedule: transformers derives layer_types from num_hidden_layers the same way for every length.
GLM_5_3_FLASH = dict(hidden_size=4096, n_routed_experts=288, n_shared_experts=1, num_experts_per_tok=8,
                     moe_intermediate_size=2048, intermediate_size=12288, vocab_size=154880, num_hidden_layers=45,
                     num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512, q_lora_rank=1536,
                     qk_nope_head_dim=256, qk_rope_head_dim=0, v_head_dim=256, n_group=1, topk_group=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=2048, index_kpool=16,
                     index_head_dim=128, index_n_heads=32, swiglu_limit=10.0, hc_mult=4, hc_eps=1e-6,
                     hc_sinkhorn_iters=20, rms_norm_eps=1e-5, max_position_embeddings=1048576,
                     linear_attn_config={"head_dim": 128, "num_heads": 64, "short_conv_kernel_size": 4,
                                         "gate_lower_bound": -5.0, "safe_gate": True})
SHAPES = {"qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B), "glm-5.3-flash": ("glm5_next", GLM_5_3_FLASH)}
# The CLI's shape options, by arch: the config key each sets.
EXPERT_KEYS = {"qwen3_moe": "num_experts", "glm5_next": "n_routed_experts"}


def randomize_skewed(model: torch.nn.Module, experts: int, seed: int) -> torch.nn.Module:
    """A transformers model's weights, in place, far from its init: correction biases spread, norms near one, and the
    routers spread so a few experts are strongly preferred (routing skewed, as real routing is). The random
    checkpoints of the tests and of the GGUF agreement bench."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 0.5, generator=g)
            elif "e_score_correction_bias" in name:
                p.copy_(torch.linspace(-0.3, 0.3, p.numel())[torch.randperm(p.numel(), generator=g)])
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.normal_(0.0, 0.05, generator=g)
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.shape[0] == experts:
                p.mul_(torch.linspace(0.5, 3.0, experts)[:, None])
    return model


def stand_in_tokenizer(model_dir: Path, vocab_size: int, eos: str = "<|endoftext|>") -> None:
    """A synthetic checkpoint's tokenizer, for benchmarks that send token ids: byte-level BPE over the 256 byte
    symbols, one merge and an end token, padded with [PADi] to the model's vocabulary. Kiln loads it (tokenizer.json,
    the generic fast class); scripts/glm5_next_gguf.py writes it into a GGUF as it is (`kiln_stand_in`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {s: i for i, s in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["ĠĠ"] = len(vocab)
    vocab[eos] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"[PAD{i}]"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "Ġ")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eos])
    tok.save(str(Path(model_dir) / "tokenizer.json"))
    (Path(model_dir) / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos, "kiln_stand_in": True}))


def synth_config(arch: str = "qwen3_moe", **over) -> dict:
    over = {k: v for k, v in over.items() if v is not None}
    if arch == "glm5_next":
        cfg = {**GLM_5_3_FLASH, **over}
        lin = cfg["linear_attn_config"]
        n = cfg["num_hidden_layers"]
        return {"architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next", "attention_bias": False,
                "first_k_dense_replace": min(3, n), "mla_use_nope": True, "hidden_act": "silu",
                "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": None, "eos_token_id": None,
                "layer_types": ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)],
                **cfg, "linear_attn_config": dict(lin)}
    cfg = {**QWEN3_30B_A3B, **over}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
            "rope_theta": 1000000.0, "hidden_act": "silu", "dtype": "bfloat16", "bos_token_id": None,
            "eos_token_id": None, "sliding_window": None, "use_sliding_window": False, **cfg}


def moe_layers(cfg: dict) -> list[int]:
    return list(range(cfg.get("first_k_dense_replace", 0), cfg["num_hidden_layers"]))


def non_expert_tensors(cfg: dict, gen: torch.Generator, std: float, device) -> dict[str, torch.Tensor]:
    if cfg["model_type"] == "glm5_next":
        return glm5_next_tensors(cfg, gen, std, device)
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    q, kv, e = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"], cfg["num_experts"]

    def rnd(*shape):
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(torch.bfloat16).cpu()

    def ones(k):
        return torch.ones(k, dtype=torch.bfloat16)
    t = {"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h), "model.norm.weight": ones(h)}
    for l in range(n):
        p = f"model.layers.{l}"
        t.update({f"{p}.input_layernorm.weight": ones(h), f"{p}.post_attention_layernorm.weight": ones(h),
                  f"{p}.self_attn.q_proj.weight": rnd(q, h), f"{p}.self_attn.k_proj.weight": rnd(kv, h),
                  f"{p}.self_attn.v_proj.weight": rnd(kv, h), f"{p}.self_attn.o_proj.weight": rnd(h, q),
                  f"{p}.self_attn.q_norm.weight": ones(cfg["head_dim"]), f"{p}.self_attn.k_norm.weight": ones(cfg["head_dim"]),
                  f"{p}.mlp.gate.weight": rnd(e, h)})
    return t


def glm5_next_tensors(cfg: dict, gen: torch.Generator, std: float, device) -> dict[str, torch.Tensor]:
    """Every non-expert tensor of a glm5_next checkpoint in the published names and shapes the model reads
    (engine.glm5_next_config.tensor_shapes); the ones transformers keeps in fp32 in fp32, norms at one."""
    spec = Glm5Spec.from_config(cfg)
    shapes = tensor_shapes(spec, layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], vocab=cfg["vocab_size"],
                           heads=cfg["num_attention_heads"], intermediate=cfg["intermediate_size"],
                           moe_layers=moe_layers(cfg), experts=cfg["n_routed_experts"],
                           shared_intermediate=cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    out = {}
    for name, (shape, fp32) in shapes.items():
        dtype = torch.float32 if fp32 else torch.bfloat16
        if name.endswith(("norm.weight", "_scale")):
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            out[name] = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype).cpu()
    return out


def synth_store(cfg: dict, store_dir: Path, config_hash: str, gen: torch.Generator, std: float, device,
                progress=None, quant: str = "none") -> tuple[int, float]:
    """Write every layer's random expert records; returns (bytes, GB/s of the write)."""
    bf16 = ExpertLayout(cfg["hidden_size"], cfg["moe_intermediate_size"], torch.bfloat16)
    layout = bf16 if quant == "none" else ExpertLayout(bf16.hidden, bf16.intermediate, torch.uint8, "rows", quant)
    layers, e = moe_layers(cfg), cfg[EXPERT_KEYS[cfg["model_type"]]]
    plan = mf.plan_offsets(layers, e, layout.record_bytes)
    total = len(plan) * layout.record_bytes
    store_dir = Path(os.path.abspath(store_dir))
    store_dir.parent.mkdir(parents=True, exist_ok=True)
    probe(store_dir.parent)
    staging = Path(tempfile.mkdtemp(dir=store_dir.parent, prefix=f".{store_dir.name}.staging-{os.getpid()}-"))
    layer_bytes = e * layout.record_bytes
    buf = aligned_buffer(layer_bytes)
    host = torch.frombuffer(buf, dtype=layout.dtype)[:e * layout.record_elems].view(e, layout.record_elems)
    digests: list[str] = []
    pool = ThreadPoolExecutor(min(16, os.cpu_count() or 1))
    try:
        os.chmod(staging, 0o755)
        data = staging / mf.DATA
        fd = open_direct(data, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        t0 = time.perf_counter()
        try:
            os.posix_fallocate(fd, 0, total)
            for i, _ in enumerate(layers):
                recs = torch.randn((e, bf16.record_elems), generator=gen, device=device, dtype=torch.float32)
                recs = (recs * std).to(torch.bfloat16)
                recs[:, 3 * bf16.matrix_elems:] = 0            # the record's padding, as pack-store writes it
                if quant == "none":
                    host.copy_(recs.cpu())
                else:
                    for j in range(e):
                        host[j].copy_(layout.pack(*bf16.views(recs[j])))
                mv = memoryview(buf)
                digests += list(pool.map(lambda j: hashlib.sha256(mv[j * layout.record_bytes:(j + 1) * layout.record_bytes]).hexdigest(), range(e)))
                pwrite_full(fd, mv[:layer_bytes], i * layer_bytes)
                if progress:
                    progress(layer_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        gbps = total / (time.perf_counter() - t0) / 1e9
        reread = hash_records(data, [o for _, _, o in plan], layout.record_bytes)
        bad = [plan[i] for i, (a, b) in enumerate(zip(digests, reread)) if a != b]
        if bad:
            raise EngineError(f"{data}: layer {bad[0][0]} expert {bad[0][1]} reads back differently than written", Exit.INTEGRITY)
        publish_store(staging, store_dir, config_hash=config_hash, arch=cfg["model_type"], layout=layout, experts=e,
                      plan=plan, digests=digests)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        pool.shutdown()
        del host                         # the mmap is freed with its last view
    return total, gbps


def synthesize(out: Path, store: Path, *, seed: int = 0, std: float = 0.02, device: str | None = None,
               quant: str = "none", arch: str = "qwen3_moe", **shape) -> dict:
    """Checkpoint (config + non-expert safetensors) in `out`, experts in the store `store`."""
    from safetensors.torch import save_file

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = synth_config(arch, **shape)
    out = Path(os.path.abspath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.staging-"))
    gen = torch.Generator(device=dev).manual_seed(seed)
    try:
        (staging / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(non_expert_tensors(cfg, gen, std, dev), str(staging / "model.safetensors"), metadata={"format": "pt"})
        model_manifest.write(staging)
        for p in (staging, *staging.iterdir()):          # mkdtemp/save_file make them private; services read them
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    total, gbps = synth_store(cfg, Path(store), Checkpoint(out).config_hash(), gen, std, dev, quant=quant)
    return {"model": str(out), "store": str(store), "layers": cfg["num_hidden_layers"], "store_bytes": total,
            "store_write_gbps": round(gbps, 3), "quant": quant}

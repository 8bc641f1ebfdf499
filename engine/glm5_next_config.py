"""Glm5Spec: the glm5_next (GLM-5.3-Flash) config fields beyond ModelConfig, checked once when the checkpoint is
opened (engine.checkpoint), so pack-store refuses a config the engine cannot serve before it writes anything."""
from __future__ import annotations

from dataclasses import dataclass

KDA, DSA = "linear_attention", "indexed_attention"


class SpecError(ValueError):
    """A glm5_next config Kiln cannot serve; the message names the field (the caller adds the file)."""


@dataclass(frozen=True)
class Glm5Spec:
    """The glm5_next fields beyond ModelConfig, read from the transformers-5 nested config (text_config) or the
    published flat one (linear_attn_config, mla_use_nope, first_k_dense_replace, index_topk_pattern), with
    Glm5NextTextConfig's defaults and rules."""

    layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    linear_heads: int
    linear_head_dim: int
    conv_kernel: int
    lower_bound: float | None
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_kpool: int
    index_heads: int
    index_head_dim: int
    swiglu_limit: float

    @classmethod
    def from_config(cls, c: dict) -> "Glm5Spec":
        n = c["num_hidden_layers"]
        layer_types = c.get("layer_types") or [KDA if i % 4 != 3 else DSA for i in range(n)]
        layer_types = [DSA if t == "full_attention" else t for t in layer_types]
        indexer_types = c.get("indexer_types")
        if indexer_types is None:
            pattern = c.get("index_topk_pattern")
            if pattern is not None:
                indexer_types = [{"F": "full", "S": "shared"}.get(ch, ch) for ch in pattern]
            else:
                freq, offset = max(c.get("index_topk_freq", 1), 1), c.get("index_skip_topk_offset", 2)
                indexer_types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]
        lin = c.get("linear_attn_config") or {}
        lower = lin.get("gate_lower_bound", c.get("linear_lower_bound", -5.0))
        if lin and lin.get("safe_gate", True) and lower is None:
            lower = -5.0
        rope = int(c.get("qk_rope_head_dim", 0) or 0)
        if c.get("mla_use_nope") is False:
            raise SpecError("mla_use_nope false (RoPE MLA heads) is not implemented: glm5_next's DSA layers are NoPE")
        spec = cls(
            layer_types=tuple(layer_types), indexer_types=tuple(indexer_types),
            hc_mult=int(c.get("hc_mult", 4)), hc_eps=float(c.get("hc_eps", 1e-6)),
            hc_sinkhorn_iters=int(c.get("hc_sinkhorn_iters", 20)),
            linear_heads=int(lin.get("num_heads", c.get("linear_num_heads", 64))),
            linear_head_dim=int(lin.get("head_dim", c.get("linear_head_dim", 128))),
            conv_kernel=int(lin.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", 4))),
            lower_bound=None if lower is None else float(lower),
            q_lora_rank=int(c.get("q_lora_rank") or 0), kv_lora_rank=int(c.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(c.get("qk_nope_head_dim", 256)), v_head_dim=int(c.get("v_head_dim", 256)),
            index_topk=int(c.get("index_topk", 2048)), index_kpool=int(c.get("index_kpool", 16)),
            index_heads=int(c.get("index_n_heads", 32)), index_head_dim=int(c.get("index_head_dim", 128)),
            swiglu_limit=float(c.get("swiglu_limit", 10.0)))
        # Values the reference allows but Kiln does not implement, each refused by name.
        unsupported = {
            "qk_rope_head_dim": (rope, 0), "attention_bias": (bool(c.get("attention_bias", False)), False),
            "index_kpool_always_select_tail": (bool(c.get("index_kpool_always_select_tail", True)), True),
            "hidden_act": (c.get("hidden_act", "silu"), "silu"),
        }
        for key, (got, want) in unsupported.items():
            if got != want:
                raise SpecError(f"{key} {got!r} is not implemented for glm5_next (only {want!r})")
        spec.check(c)
        return spec

    def check(self, c: dict) -> None:
        n = c["num_hidden_layers"]
        mlp = c.get("mlp_layer_types")
        if mlp is not None and (bad := sorted(set(mlp) - {"dense", "sparse"})):
            raise SpecError(f"mlp_layer_types value {bad[0]!r} is not 'dense' or 'sparse'")
        for key, value in (("layer_types", self.layer_types), ("indexer_types", self.indexer_types),
                           ("mlp_layer_types", mlp if mlp is not None else [None] * n)):
            if len(value) != n:
                raise SpecError(f"{key} has {len(value)} entries, num_hidden_layers is {n}")
        if bad := sorted(set(self.layer_types) - {KDA, DSA}):
            raise SpecError(f"layer_types value {bad[0]!r} is not one of {KDA!r}, {DSA!r}")
        if bad := sorted(set(self.indexer_types) - {"full", "shared"}):
            raise SpecError(f"indexer_types value {bad[0]!r} is not 'full' or 'shared'")
        for i, (kind, idx) in enumerate(zip(self.layer_types, self.indexer_types)):
            # transformers hands a shared layer the selection of the layer just before it, and only a full DSA one
            if kind == DSA and idx == "shared" and (i == 0 or self.layer_types[i - 1] != DSA
                                                    or self.indexer_types[i - 1] != "full"):
                raise SpecError(f"indexer_types[{i}] 'shared' needs a full DSA layer at {i - 1}")
        if self.q_lora_rank <= 0:
            raise SpecError("q_lora_rank must be a positive integer (DSA layers need the q LoRA)")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise SpecError(f"index_topk {self.index_topk} must be a multiple of index_kpool {self.index_kpool} >= 1")
        for key in ("hc_mult", "hc_sinkhorn_iters", "linear_heads", "linear_head_dim", "conv_kernel", "kv_lora_rank",
                    "qk_nope_head_dim", "v_head_dim", "index_heads", "index_head_dim"):
            if getattr(self, key) < 1:
                raise SpecError(f"{key} {getattr(self, key)} must be positive")

    @property
    def qkv_dim(self) -> int:
        return self.linear_heads * self.linear_head_dim


def tensor_shapes(spec: Glm5Spec, *, layers: int, hidden: int, vocab: int, heads: int, intermediate: int,
                  moe_layers, experts: int, shared_intermediate: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every non-expert tensor of a glm5_next checkpoint in the published names → (shape, kept in fp32 by
    transformers): what the model reads (engine.models.glm5_next checks each against it) and what engine synth
    writes."""
    s, hc, qkv, ihd = spec, spec.hc_mult, spec.qkv_dim, spec.index_head_dim
    lh, ld, qr, r = s.linear_heads, s.linear_head_dim, s.q_lora_rank, s.kv_lora_rank
    out = {"model.embed_tokens.weight": ((vocab, hidden), False), "lm_head.weight": ((vocab, hidden), False),
           "model.norm.weight": ((hidden,), False)}
    moe = set(moe_layers)
    for l in range(layers):
        p, a, m = f"model.layers.{l}", f"model.layers.{l}.self_attn", f"model.layers.{l}.mlp"
        t = {f"{p}.input_layernorm.weight": ((hidden,), False), f"{p}.post_attention_layernorm.weight": ((hidden,), False)}
        for which in ("attn", "ffn"):
            t |= {f"{p}.hc_{which}_fn": (((2 + hc) * hc, hc * hidden), True),
                  f"{p}.hc_{which}_base": (((2 + hc) * hc,), True), f"{p}.hc_{which}_scale": ((3,), True)}
        if s.layer_types[l] == KDA:
            t |= {f"{a}.{x}_proj.weight": ((qkv, hidden), False) for x in "qkv"}
            t |= {f"{a}.{x}_conv1d.weight": ((qkv, 1, s.conv_kernel), True) for x in "qkv"}
            t |= {f"{a}.f_a_proj.weight": ((ld, hidden), False), f"{a}.f_b_proj.weight": ((qkv, ld), False),
                  f"{a}.dt_bias": ((qkv,), True), f"{a}.A_log": ((lh,), True), f"{a}.b_proj.weight": ((lh, hidden), False),
                  f"{a}.g_a_proj.weight": ((ld, hidden), False), f"{a}.g_b_proj.weight": ((qkv, ld), False),
                  f"{a}.o_norm.weight": ((ld,), True), f"{a}.o_proj.weight": ((hidden, qkv), False)}
        else:
            nope, vd = s.qk_nope_head_dim, s.v_head_dim
            t |= {f"{a}.q_a_proj.weight": ((qr, hidden), False), f"{a}.q_a_layernorm.weight": ((qr,), False),
                  f"{a}.q_b_proj.weight": ((heads * nope, qr), False),
                  f"{a}.kv_a_proj_with_mqa.weight": ((r, hidden), False),
                  f"{a}.kv_a_layernorm.weight": ((r,), False), f"{a}.kv_b_proj.weight": ((heads * (nope + vd), r), False),
                  f"{a}.o_proj.weight": ((hidden, heads * vd), False)}
            if s.indexer_types[l] == "full":
                i = f"{a}.indexer"
                t |= {f"{i}.wq_b.weight": ((s.index_heads * ihd, qr), False), f"{i}.wk.weight": ((ihd, hidden), False),
                      f"{i}.k_norm.weight": ((ihd,), False), f"{i}.k_norm.bias": ((ihd,), False),
                      f"{i}.weights_proj.weight": ((s.index_heads, hidden), False),
                      f"{i}.index_kpool_compress_ape": ((s.index_kpool, ihd), True),
                      f"{i}.index_kpool_compress_gate": ((ihd, hidden), False)}
        if l in moe:
            t |= {f"{m}.gate.weight": ((experts, hidden), True), f"{m}.gate.e_score_correction_bias": ((experts,), True)}
            t |= {f"{m}.shared_experts.{x}_proj.weight": ((shared_intermediate, hidden), False) for x in ("gate", "up")}
            t[f"{m}.shared_experts.down_proj.weight"] = ((hidden, shared_intermediate), False)
        else:
            t |= {f"{m}.{x}_proj.weight": ((intermediate, hidden), False) for x in ("gate", "up")}
            t[f"{m}.down_proj.weight"] = ((hidden, intermediate), False)
        out |= t
    return out

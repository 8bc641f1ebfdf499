"""ModelConfig: the part of a checkpoint's config.json the engine's models need, checked once.

Reads published configs (top-level `rope_theta`, `partial_rotary_factor`, `rope_scaling`) and
transformers 5's save_pretrained configs (`rope_parameters: {rope_theta, rope_type, ...}`) alike,
and applies the same defaults as transformers' Qwen3MoeConfig / Glm4MoeConfig / MixtralConfig,
so a config.json means the same model here as there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint import Checkpoint, CheckpointError

# Routing families. "softmax": softmax over all experts, top-k, optionally renormalised (Qwen3-MoE; Mixtral
# always renormalises, which equals a softmax over the top-k logits). "sigmoid_grouped": GLM-4.5's sigmoid
# scores with a selection-only correction bias, group-limited top-k and a routed scaling factor.
ROUTING = {"qwen3_moe": "softmax", "mixtral": "softmax", "glm4_moe": "sigmoid_grouped", "glm5_next": "sigmoid_grouped"}

# transformers' per-architecture defaults for keys a published config.json may omit.
_DEFAULTS = {
    "qwen3_moe": dict(rope_theta=10000.0, partial_rotary_factor=1.0, norm_topk_prob=False, use_qk_norm=True,
                      attention_bias=False, rms_norm_eps=1e-6),
    "mixtral": dict(rope_theta=1e6, partial_rotary_factor=1.0, norm_topk_prob=True, use_qk_norm=False,
                    attention_bias=False, rms_norm_eps=1e-5),
    "glm4_moe": dict(rope_theta=10000.0, partial_rotary_factor=0.5, norm_topk_prob=True, use_qk_norm=False,
                     attention_bias=False, rms_norm_eps=1e-5),
    # NoPE attention: the rope keys only satisfy the shared checks (engine.models.glm5_next reads its own fields)
    "glm5_next": dict(rope_theta=10000.0, partial_rotary_factor=1.0, norm_topk_prob=True, use_qk_norm=False,
                      attention_bias=False, rms_norm_eps=1e-5, max_position_embeddings=1048576),
}


def _require(cond: bool, where: str, msg: str) -> None:
    # Not `assert`: a bad config.json is user input and must fail the same way under `python -O`.
    if not cond:
        raise CheckpointError(f"{where}: {msg}")


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rotary_dim: int                 # leading part of each head that is rotated (GLM: head_dim * 0.5)
    max_position_embeddings: int
    sliding_window: int | None
    tie_word_embeddings: bool
    use_qk_norm: bool
    eos_token_ids: frozenset[int]
    # MoE
    routing: str
    n_experts: int
    top_k: int
    moe_intermediate: int
    intermediate: int               # dense MLP width (GLM's first layers, Qwen's mlp_only_layers)
    moe_layers: tuple[int, ...]
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> "ModelConfig":
        c, arch = ckpt.config, ckpt.arch
        where = str(ckpt.config_path)   # config.json, or the GGUF its keys came from
        d = _DEFAULTS[arch]
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok"):
            _require(isinstance(c.get(key), int) and c[key] > 0, where, f"{key} must be a positive integer")
        heads = c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or c["hidden_size"] // heads

        # Rope: transformers 5 nests it in rope_parameters; published configs keep it top level.
        rope = dict(c.get("rope_parameters") or {})
        scaling = c.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        _require(rope_type == "default", where, f"rope_type {rope_type!r} is not supported (only 'default')")
        theta = float(rope.get("rope_theta", c.get("rope_theta", d["rope_theta"])))
        partial = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", d["partial_rotary_factor"])))
        rotary_dim = int(head_dim * partial)
        _require(0 < rotary_dim <= head_dim and rotary_dim % 2 == 0, where,
                 f"rotary dim {rotary_dim} (head_dim {head_dim} x partial_rotary_factor {partial}) must be even "
                 f"and within the head")

        window = c.get("sliding_window")
        if arch == "qwen3_moe" and not c.get("use_sliding_window", False):
            window = None                # Qwen3MoeConfig drops the window unless use_sliding_window

        eos = _ids(c.get("eos_token_id"))
        gen_cfg = ckpt.dir / "generation_config.json"
        if gen_cfg.exists():
            eos |= _ids(json.loads(gen_cfg.read_text()).get("eos_token_id"))

        top_k = c["num_experts_per_tok"]
        grouped = ROUTING[arch] == "sigmoid_grouped"
        n_group = int(c.get("n_group", 1) or 1) if grouped else 1
        topk_group = int(c.get("topk_group", 1) or 1) if grouped else 1
        cfg = cls(
            arch=arch,
            vocab_size=c["vocab_size"],
            hidden=c["hidden_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_eps=float(c.get("rms_norm_eps", d["rms_norm_eps"])),
            rope_theta=theta,
            rotary_dim=rotary_dim,
            max_position_embeddings=int(c.get("max_position_embeddings", d.get("max_position_embeddings", 4096))),
            sliding_window=int(window) if window else None,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            use_qk_norm=bool(c.get("use_qk_norm", d["use_qk_norm"])),
            eos_token_ids=frozenset(eos),
            routing=ROUTING[arch],
            n_experts=ckpt.n_experts,
            top_k=top_k,
            moe_intermediate=ckpt.moe_intermediate,
            intermediate=int(c.get("intermediate_size", 0) or 0),
            moe_layers=tuple(ckpt.moe_layers),
            norm_topk_prob=bool(c.get("norm_topk_prob", d["norm_topk_prob"])),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0) or 1.0),
            n_group=n_group,
            topk_group=topk_group,
            n_shared_experts=int(c.get("n_shared_experts", 0) or 0) if grouped else 0,
        )
        cfg.check(where)
        return cfg

    def check(self, where: str = "config") -> None:
        """The invariants the models rely on; each failure names the keys involved."""
        _require(self.num_heads % self.num_kv_heads == 0, where,
                 f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        _require(self.head_dim > 0 and self.head_dim % 2 == 0, where, f"head_dim {self.head_dim} must be positive and even")
        _require(1 <= self.top_k <= self.n_experts, where,
                 f"num_experts_per_tok {self.top_k} must be within 1..{self.n_experts} experts")
        _require(bool(self.moe_layers), where, "no layer has routed experts")
        _require(all(0 <= l < self.num_layers for l in self.moe_layers), where, "MoE layer index out of range")
        dense = len(self.moe_layers) < self.num_layers
        _require(not dense or self.intermediate > 0, where, "dense layers need intermediate_size > 0")
        if self.routing == "sigmoid_grouped":
            _require(self.n_experts % self.n_group == 0, where,
                     f"n_routed_experts {self.n_experts} is not divisible by n_group {self.n_group}")
            per_group = self.n_experts // self.n_group
            # Glm4Moe scores a group by the sum of its top-2 experts.
            _require(per_group >= 2, where, f"n_group {self.n_group} leaves fewer than 2 experts per group")
            _require(1 <= self.topk_group <= self.n_group, where,
                     f"topk_group {self.topk_group} must be within 1..n_group {self.n_group}")
            _require(self.top_k <= self.topk_group * per_group, where,
                     f"num_experts_per_tok {self.top_k} exceeds the {self.topk_group * per_group} experts "
                     f"of the topk_group {self.topk_group} selected groups")


def load_config(model_dir: str | Path) -> ModelConfig:
    return ModelConfig.from_checkpoint(Checkpoint(model_dir))

"""llama.cpp's `glm5-next` GGUF (GLM-5.3-Flash, as convert_hf_to_gguf.py's Glm5NextModel writes it) read back as
the glm5_next checkpoint it was converted from: the config from the metadata, each tensor's transformers name and
the inverse of what the converter did to it. engine.gguf_model calls these for that architecture only.

The converter's transforms, each undone here exactly (F32 files give back the checkpoint's numbers; A_log within
an ulp, since the file holds -exp(A_log)):
  - kv_b_proj [H·(nope+v), r] split per head into attn_k_b (stored transposed: ggml [nope, r, H]) and attn_v_b
    (ggml [r, v, H]): joined back per head as [k_bᵀ; v_b];
  - A_log stored as ssm_a = -exp(A_log): A_log = log(-ssm_a);
  - dt_bias renamed ssm_dt.bias; the short convs [C, 1, K] stored as ggml [K, 1, C, 1]: reshaped back;
  - the mHC and indexer-pool parameters given a `.weight` suffix; routed experts stacked (read per expert by
    engine.gguf_model's expert slices).
Metadata the converter writes only when set is read with the converter's own meaning of absent: no
`kda.gate_lower_bound` is the softplus forget gate (llama.cpp's -inf), no `attention.indexer.types` is every DSA
layer running its own indexer. A layer kind comes from `attention.head_count_kv` (0: KDA, else DSA).

Errors are ValueError with a one-line reason; engine.gguf_model names the file and makes it GgufError (BAD_MODEL).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from engine.glm5_next_config import DSA, KDA, Glm5Spec, SpecError, tensor_shapes

ARCH = "glm5-next"

# llama.cpp block names → transformers' (after `model.layers.N.`), plain copies.
_PLAIN = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    # KDA
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "ssm_f_a.weight": "self_attn.f_a_proj.weight",
    "ssm_f_b.weight": "self_attn.f_b_proj.weight", "ssm_beta.weight": "self_attn.b_proj.weight",
    "ssm_g_a.weight": "self_attn.g_a_proj.weight", "ssm_g_b.weight": "self_attn.g_b_proj.weight",
    "ssm_norm.weight": "self_attn.o_norm.weight", "ssm_dt.bias": "self_attn.dt_bias",
    # MLA
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    # DSA indexer
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight", "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight", "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "self_attn.indexer.index_kpool_compress_ape",
    "indexer_compressor_gate.weight": "self_attn.indexer.index_kpool_compress_gate",
    # mHC
    **{f"hc_{w}_{p}.weight": f"hc_{w}_{p}" for w in ("attn", "ffn") for p in ("fn", "base", "scale")},
    # MLP: dense, router, shared expert
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_CONV = {f"ssm_conv1d_{x}.weight": f"self_attn.{x}_conv1d.weight" for x in "qkv"}
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}


def config(field: Callable, tensors: dict) -> dict:
    """The published flat glm5_next config.json keys from the file's metadata (`field(key, default)` reads one)."""
    a = ARCH

    def need(key):
        v = field(f"{a}.{key}")
        if v is None:
            raise ValueError(f"metadata {a}.{key} is missing")
        return v

    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError("no token_embd.weight tensor")
    n = int(need("block_count")) - int(field(f"{a}.nextn_predict_layers", 0) or 0)
    heads = int(need("attention.head_count"))
    kv = need("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * n
    if len(kv) < n:
        raise ValueError(f"{a}.attention.head_count_kv has {len(kv)} entries for {n} layers")
    layer_types = [KDA if int(k) == 0 else DSA for k in kv[:n]]
    full = field(f"{a}.attention.indexer.types")
    indexer = ["full"] * n if full is None else ["full" if f else "shared" for f in list(full)[:n]]
    lower = field(f"{a}.kda.gate_lower_bound")
    dense = int(field(f"{a}.leading_dense_block_count", 0) or 0)
    gating = field(f"{a}.expert_gating_func", 2)
    if gating not in (0, 2):          # llama.cpp: none means sigmoid for this architecture
        raise ValueError(f"{a}.expert_gating_func {gating} is not sigmoid (2)")
    clamp = {float(x) for x in (field(f"{a}.swiglu_clamp_exp") or []) } | \
        {float(x) for x in (field(f"{a}.swiglu_clamp_shexp") or [])}
    if len(clamp) > 1:
        raise ValueError(f"{a}.swiglu_clamp_exp/_shexp differ per layer ({sorted(clamp)}); Kiln has one swiglu_limit")
    rope = int(field(f"{a}.rope.dimension_count", 0) or 0)
    k_mla = int(need("attention.key_length_mla"))
    eos = [field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    c = {
        "model_type": "glm5_next", "architectures": [f"GGUF:{a}"],
        "vocab_size": int(embd.shape[-1]), "hidden_size": int(need("embedding_length")), "num_hidden_layers": n,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "intermediate_size": int(field(f"{a}.feed_forward_length", 0) or 0),
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "n_routed_experts": int(need("expert_count")), "num_experts_per_tok": int(need("expert_used_count")),
        "n_shared_experts": int(field(f"{a}.expert_shared_count", 0) or 0),
        "routed_scaling_factor": float(field(f"{a}.expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(field(f"{a}.expert_weights_norm", False)),
        "n_group": int(field(f"{a}.expert_group_count", 1) or 1),
        "topk_group": int(field(f"{a}.expert_group_used_count", 1) or 1),
        "first_k_dense_replace": dense,
        "mlp_layer_types": ["dense" if l < dense else "sparse" for l in range(n)],
        "layer_types": layer_types, "indexer_types": indexer,
        "linear_attn_config": {"num_heads": heads, "head_dim": int(need("kda.head_dim")),
                               "short_conv_kernel_size": int(need("ssm.conv_kernel")),
                               "gate_lower_bound": None if lower is None else float(lower),
                               "safe_gate": lower is not None},
        "mla_use_nope": rope == 0, "qk_rope_head_dim": rope,
        "q_lora_rank": int(need("attention.q_lora_rank")), "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "qk_nope_head_dim": k_mla - rope, "v_head_dim": int(need("attention.value_length_mla")),
        "index_topk": int(need("attention.indexer.top_k")), "index_kpool": int(need("attention.indexer.kpool")),
        "index_n_heads": int(need("attention.indexer.head_count")),
        "index_head_dim": int(need("attention.indexer.key_length")),
        "index_kpool_always_select_tail": bool(field(f"{a}.attention.indexer.kpool_select_tail", False)),
        "hc_mult": int(need("hyper_connection.count")),
        "hc_sinkhorn_iters": int(need("hyper_connection.sinkhorn_iterations")),
        "hc_eps": float(need("hyper_connection.epsilon")),
        "swiglu_limit": clamp.pop() if clamp else math.inf,
        "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": sorted({int(e) for e in eos if e is not None}),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "pad_token_id": field("tokenizer.ggml.padding_token_id"),
    }
    try:
        Glm5Spec.from_config(c)
    except SpecError as e:
        raise ValueError(str(e)) from None
    return c


def sources(c: dict, names) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """transformers name → (GGUF tensor, transform, further GGUF tensors) for every non-expert tensor in `names`
    (the file's tensor names); expert tensors are left to the caller. ValueError for a tensor with no place."""
    out: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    n, names = c["num_hidden_layers"], set(names)
    for name in names:
        if name in GLOBAL:
            out[GLOBAL[name]] = (name, "", ())
            continue
        parts = name.split(".", 2)
        if parts[0] != "blk" or len(parts) != 3 or not parts[1].isdigit():
            raise ValueError(f"tensor {name} has no place in a {ARCH} model")
        layer, rest = int(parts[1]), parts[2]
        p = f"model.layers.{layer}"
        if layer >= n:
            out[f"{p}.nextn.{rest}"] = (name, "", ())        # the MTP block: loaded by nothing, as transformers does
        elif rest in EXPERTS:
            continue
        elif rest in _PLAIN:
            out[f"{p}.{_PLAIN[rest]}"] = (name, "", ())
        elif rest in _CONV:
            out[f"{p}.{_CONV[rest]}"] = (name, "conv", ())
        elif rest == "ssm_a":
            out[f"{p}.self_attn.A_log"] = (name, "a_log", ())
        elif rest == "attn_k_b.weight":
            v_b = f"blk.{layer}.attn_v_b.weight"
            if v_b not in names:
                raise ValueError(f"tensor {name} has no {v_b} beside it")
            out[f"{p}.self_attn.kv_b_proj.weight"] = (name, "kv_b", (v_b,))
        elif rest == "attn_v_b.weight":
            if f"blk.{layer}.attn_k_b.weight" not in names:
                raise ValueError(f"tensor {name} has no blk.{layer}.attn_k_b.weight beside it")
        else:
            raise ValueError(f"tensor {name} has no place in a {ARCH} model")
    return out


def transform(kind: str, ts: list[torch.Tensor], c: dict) -> torch.Tensor:
    """Undo the converter's `kind` on the tensors read (torch order, float32)."""
    if kind == "a_log":
        return torch.log(-ts[0].reshape(-1).double()).float()
    if kind == "conv":
        k = ts[0].shape[-1]
        return ts[0].reshape(-1, 1, k).contiguous()
    if kind == "kv_b":
        heads = c["num_attention_heads"]
        k_b, v_b = ts[0].reshape(heads, c["kv_lora_rank"], -1), ts[1].reshape(heads, -1, c["kv_lora_rank"])
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, c["kv_lora_rank"]).contiguous()
    raise AssertionError(kind)


def _tensor_shapes(c: dict) -> tuple[Glm5Spec, list[int], dict]:
    """The config's spec, its MoE layers and every transformers tensor's shape (glm5_next_config.tensor_shapes)."""
    spec = Glm5Spec.from_config(c)
    moe = [l for l in range(c["num_hidden_layers"]) if l >= c["first_k_dense_replace"]]
    return spec, moe, tensor_shapes(spec, layers=c["num_hidden_layers"], hidden=c["hidden_size"],
                                    vocab=c["vocab_size"], heads=c["num_attention_heads"],
                                    intermediate=c["intermediate_size"], moe_layers=moe,
                                    experts=c["n_routed_experts"],
                                    shared_intermediate=c["moe_intermediate_size"] * c["n_shared_experts"])


def expected_shapes(c: dict, src: dict) -> dict[str, list[int]]:
    """Each GGUF tensor's ggml shape as the config makes it (the converter's layout of tensor_shapes)."""
    spec, moe, shapes = _tensor_shapes(c)
    want: dict[str, list[int]] = {}
    heads, r = c["num_attention_heads"], c["kv_lora_rank"]
    for name, (gguf, kind, more) in src.items():
        if name not in shapes:
            continue
        shape = list(shapes[name][0])
        if kind == "conv":
            want[gguf] = [shape[2], 1, shape[0], 1]
        elif kind == "kv_b":
            want[gguf] = [spec.qk_nope_head_dim, r, heads]
            want[more[0]] = [r, spec.v_head_dim, heads]
        else:
            want[gguf] = shape[::-1]
    h, i, e = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    for l in moe:
        want |= {f"blk.{l}.ffn_gate_exps.weight": [h, i, e], f"blk.{l}.ffn_up_exps.weight": [h, i, e],
                 f"blk.{l}.ffn_down_exps.weight": [i, h, e]}
    return want


def required(c: dict) -> list[str]:
    """The transformers names the model reads (lm_head only where not tied)."""
    names = _tensor_shapes(c)[2]
    return [n for n in names if not (n == "lm_head.weight" and c["tie_word_embeddings"])]

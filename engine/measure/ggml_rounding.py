"""llama.cpp's CPU rounding, emulated on the fp32 reference (issue 29: why Kiln and llama.cpp differ on one GGUF).

ggml's CPU matmul of a quantized weight does not multiply the float activations: it first converts each input row to
the weight type's `vec_dot_type` (ggml-cpu.c's type_traits_cpu) and takes integer dot products against the weight's
blocks. q8_0 (blocks of 32, for Q4_0/Q5_0/Q8_0/IQ4_NL weights; q8_1, for Q4_1/Q5_1, rounds the values the same) and
q8_K (blocks of 256, for every K-quant and IQ4_XS) keep 8 bits per activation. Its KV cache is F16 and its flash
attention converts Q to F16 too. Kiln multiplies the dequantized weights with float activations.

This module puts that rounding, and only it, on the fp32 transformers model: `emulated_logprobs` loads the checkpoint
a GGUF was converted from, replaces its weights by the file's own (the gguf package's dequantization, q/k rows put
back in Hugging Face order), and while it runs rounds every matmul input as ggml would for that weight's type
(`round_q8_0`, `round_q8_K`) and, optionally, attention's Q, K and V to F16. If llama.cpp's distance from Kiln is
that rounding, this model sits near llama.cpp and away from Kiln. A measurement, never the serving engine.

Not emulated: q8_1's fp16 block sum (a Q4_1/Q5_1 weight's min term uses it), flash attention's F16 accumulation of V,
the order of float sums.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import torch.nn.functional as F

QK8_0, QK_K = 32, 256
# ggml-cpu.c's type_traits_cpu[type].vec_dot_type for the weight types llama-quantize writes; absent: float input
Q8_0_INPUT = {"Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "Q4_1", "Q5_1"}     # q8_1's values are q8_0's (its extra sum aside)
Q8_K_INPUT = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS",
              "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"}


def _c(v: float, like: torch.Tensor) -> torch.Tensor:
    """A constant as a tensor: torch computes `number / tensor` as number * (1 / tensor), one rounding more than C's
    float division (measured: -127 / 3.0 gave -42.333336, C's -42.333332)."""
    return torch.full_like(like, v)


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x (float32, last dim a multiple of 32) as ggml's x86 quantize_row_q8_0 leaves it, dequantized: per block of 32,
    q = round-half-even(x * (127 / amax)) and the value q * fp16(amax / 127) (its AVX2 path; the scalar reference
    multiplies by 1 / d and rounds half away from zero, which differ only at exact ties)."""
    b = x.float().reshape(*x.shape[:-1], -1, QK8_0)
    amax = b.abs().amax(-1, keepdim=True)
    d = (amax / _c(127, amax)).half().float()
    iscale = torch.where(amax > 0, _c(127, amax) / amax, torch.zeros_like(amax))
    return (torch.round(b * iscale) * d).reshape(x.shape)


def round_q8_K(x: torch.Tensor) -> torch.Tensor:
    """x (float32, last dim a multiple of 256) as ggml's quantize_row_q8_K_ref leaves it (x86 calls the reference),
    dequantized: per block of 256, max = the element of largest magnitude (the first such), iscale = -127 / max,
    q = min(127, nearest_int(iscale * x)) (round half to even), and the value q * (1 / iscale), d kept in float32."""
    b = x.float().reshape(*x.shape[:-1], -1, QK_K)
    idx = b.abs().argmax(-1, keepdim=True)          # torch's argmax takes the first of equal maxima, as ggml's `>`
    mx = b.gather(-1, idx)
    iscale = torch.where(mx != 0, _c(-127, mx) / mx, torch.zeros_like(mx))
    q = torch.round(b * iscale).clamp(max=127)
    d = torch.where(mx != 0, _c(1, mx) / iscale, torch.zeros_like(mx))
    return (q * d).reshape(x.shape)


def input_rounding(ggml_type: str):
    """The rounding ggml's CPU matmul gives an input row against a weight of `ggml_type` (None: none, F32)."""
    if ggml_type in Q8_0_INPUT:
        return round_q8_0
    if ggml_type in Q8_K_INPUT:
        return round_q8_K
    if ggml_type in ("F32",):
        return None
    if ggml_type in ("F16", "BF16"):
        return (lambda x: x.half().float()) if ggml_type == "F16" else (lambda x: x.bfloat16().float())
    raise ValueError(f"weight type {ggml_type}: its vec_dot_type is not in this emulation")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute undone (rows back in Hugging Face's rotary order)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(path: str | os.PathLike, cfg) -> dict[str, tuple[torch.Tensor, str]]:
    """A llama-architecture GGUF (the Mixtral form bench/gguf_files.py makes of SmolLM2) as the Hugging Face Mixtral
    state dict's names → (float32 tensor, the file's ggml type); the fused expert gate_up as two entries,
    `...gate_up_proj:gate` and `:up`."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    r = GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch}; the emulation maps llama-architecture files only")
    per_layer = {"attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
                 "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
                 "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
                 "ffn_gate_inp": "mlp.gate.weight", "ffn_gate_exps": "mlp.experts.gate_up_proj:gate",
                 "ffn_up_exps": "mlp.experts.gate_up_proj:up", "ffn_down_exps": "mlp.experts.down_proj"}
    out = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        kind = t.tensor_type.name
        if t.name == "token_embd.weight":
            out["model.embed_tokens.weight"] = (torch.from_numpy(w.copy()), kind)
        elif t.name == "output.weight":
            out["lm_head.weight"] = (torch.from_numpy(w.copy()), kind)
        elif t.name == "output_norm.weight":
            out["model.norm.weight"] = (torch.from_numpy(w.copy()), kind)
        else:
            _, layer, name, _ = t.name.split(".")
            if name == "attn_q":
                w = _unpermute(w, cfg.num_attention_heads)
            elif name == "attn_k":
                w = _unpermute(w, cfg.num_key_value_heads)
            out[f"model.layers.{layer}.{per_layer[name]}"] = (torch.from_numpy(np.ascontiguousarray(w)), kind)
    return out


class _Rounded:
    """F.linear and scaled_dot_product_attention, rounding their inputs as llama.cpp's CPU would, while active.
    Weights are recognized by storage address (a fused expert slice by its rows: gate and up may differ in type)."""

    def __init__(self, plan: dict[int, list[tuple[int, int, object]]], attention_f16: bool):
        self.plan, self.attention_f16 = plan, attention_f16
        self.linear, self.sdpa = F.linear, F.scaled_dot_product_attention

    def _linear(self, x, weight, bias=None):
        parts = self.plan.get(weight.data_ptr())
        if parts is None:
            return self.linear(x, weight, bias)
        outs = [self.linear(fn(x) if fn else x, weight[a:b]) for a, b, fn in parts]
        y = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
        return y + bias if bias is not None else y

    def _sdpa(self, q, k, v, *args, **kw):
        if self.attention_f16:
            q, k, v = (t.half().float() for t in (q, k, v))
        return self.sdpa(q, k, v, *args, **kw)

    @contextlib.contextmanager
    def active(self):
        F.linear, F.scaled_dot_product_attention = self._linear, self._sdpa
        try:
            yield
        finally:
            F.linear, F.scaled_dot_product_attention = self.linear, self.sdpa


def emulated_logprobs(ckpt: str | os.PathLike, gguf: str | os.PathLike, ids: list[int], *,
                      activations: bool = True, attention_f16: bool = False) -> torch.Tensor:
    """The fp32 transformers model of `ckpt` with the weights of `gguf` (the file's own blocks, dequantized), every
    position's log-probabilities [n, vocab]; `activations`: each matmul input rounded to the weight type's
    vec_dot_type as ggml's CPU does; `attention_f16`: attention's Q, K, V rounded to F16 (its F16 KV cache, its
    flash attention's F16 Q). Neither: the file's weights with float arithmetic (Kiln's arithmetic)."""
    from transformers import AutoModelForCausalLM
    # eager experts: transformers otherwise runs them as one grouped matmul, past F.linear and so past the rounding
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="sdpa",
                                                 experts_implementation="eager").eval()
    weights = gguf_weights(gguf, model.config)
    params = dict(model.named_parameters())
    plan: dict[int, list[tuple[int, int, object]]] = {}
    with torch.no_grad():
        for name, (w, kind) in weights.items():
            base, _, half = name.partition(":")
            p = params[base]
            if half:                                  # one half of the fused [E, 2*inter, hidden] gate_up
                inter = p.shape[1] // 2
                p[:, (0 if half == "gate" else inter):(inter if half == "gate" else 2 * inter)].copy_(w)
            else:
                if tuple(p.shape) != tuple(w.shape):
                    raise ValueError(f"{gguf}: {name} is {tuple(w.shape)}, the checkpoint's {tuple(p.shape)}")
                p.copy_(w)
    kinds = {n: k for n, (_, k) in weights.items()}
    if "lm_head.weight" not in kinds:                 # tied: the output matmul is token_embd's
        kinds["lm_head.weight"] = kinds["model.embed_tokens.weight"]
    for name, p in model.named_parameters():
        fn_of = (lambda k: input_rounding(k) if activations else None)
        if name.endswith("experts.gate_up_proj"):
            inter = p.shape[1] // 2
            g, u = fn_of(kinds[name + ":gate"]), fn_of(kinds[name + ":up"])
            for e in range(p.shape[0]):
                plan[p[e].data_ptr()] = [(0, inter, g), (inter, 2 * inter, u)]
        elif name.endswith("experts.down_proj"):
            for e in range(p.shape[0]):
                plan[p[e].data_ptr()] = [(0, p.shape[1], fn_of(kinds[name]))]
        elif p.dim() == 2 and not name.endswith("embed_tokens.weight") and name in kinds:
            plan[p.data_ptr()] = [(0, p.shape[0], fn_of(kinds[name]))]
    if model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        plan[model.lm_head.weight.data_ptr()] = [(0, model.lm_head.weight.shape[0], fn_of(kinds["lm_head.weight"]))]
    with torch.inference_mode(), _Rounded(plan, attention_f16).active():
        logits = model(torch.tensor([list(ids)])).logits[0].float()
    return F.log_softmax(logits, -1)

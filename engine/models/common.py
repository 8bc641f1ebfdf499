"""Layers shared by the engine's MoE models, each matching its transformers counterpart.

Every model is: embedding → N × (RMSNorm → attention → residual, RMSNorm → MLP or MoE → residual)
→ RMSNorm → lm_head. The architectures differ only in attention details (q/k norm, biases,
partial rotary — all read from ModelConfig here) and in their MLP/MoE block (one file each).

The forward is split in the manner of nano-vllm/gpt-fast: `prefill` (one sequence, many tokens)
and `decode_step` (many sequences, one token each) over a KVCache allocated once. Step metadata
(rotary rows, mask, slot indices) is built once per step, never per layer, and nothing here reads
a device value back to the host. On CUDA a decode step runs fused Triton kernels for everything but
the matmuls (engine.kernels.triton_decode: residual+norm, q/k norm+rotary+KV write, attention, routing);
on the CPU a one-sequence decode step runs the engine's C++ kernels (engine.kernels.native: a layer's
attention half in one call, the expert in another, MoEModel._run_native); the torch forms below are the same
functions, used for prefill, batched CPU decode and with fused_kernels / native_kernels off.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.model_config import ModelConfig
from engine.experts.provider import ExpertProvider, Predictor
from engine.gpu.graphs import DecodeGraphs
from engine.kernels import native, triton_decode
from engine.kernels.quant_cpu import native_ffn_group
from engine.quant import ggml
from engine.kv_cache import KVCache, kv_bucket, kv_buckets, select
from engine.checkpoint_projections import dense_projection, gguf_projection
from engine.dense_weights import Int4Projection, Projection, Q8Projection
from engine.gguf_tensors import BlockProjection
from engine.sampling import Penalties, Picks, RowSpec, mode

if TYPE_CHECKING:
    from torch.nn.attention.bias import CausalBias

log = logging.getLogger("engine.models")


class WeightSource(Protocol):
    """Non-expert checkpoint tensors, already on the model's device and dtype (see engine.loader)."""

    device: torch.device | str
    dtype: torch.dtype
    int8_activations: bool      # EngineConfig.cpu_activations "int8": a GGUF's blocks stay blocks (gguf_tensors)

    def get(self, name: str, *, fp32: bool = False) -> torch.Tensor: ...

    def maybe(self, name: str) -> torch.Tensor | None: ...

    def blocks(self, name: str) -> tuple[str, torch.Tensor] | None: ...

    def ggml_blocks(self, name: str) -> tuple[str, torch.Tensor] | None: ...


def native_tail(model: "MoEModel", provider: ExpertProvider) -> native.MoETail | None:
    """The native MoE half for a model's one-token CPU decode (engine.kernels.native.MoETail) where its provider
    hands out host records (host_records) of a layout the native int4 FFN computes (MoETail) or of a GGUF's own
    types (ggml: records, GgmlTail), else None."""
    quant = provider.layout.quantized
    if not provider.hands_out_host_records or quant is None or model.cfg.top_k > native.MAX_TOP_K:
        return None
    if quant.mixed:         # a GGUF's experts in their own types (ggml: records): every type needs its kernel
        if not all(native.ggml_supported(ggml.ggml_type(t).code) for t in quant.capacity):
            return None
        return native.GgmlTail(quant.regions, quant.hidden, quant.intermediate, model.cfg.top_k, provider.swiglu_limit)
    g = native_ffn_group(quant)
    return None if g is None else native.MoETail(quant.regions, quant.hidden, quant.intermediate, g, model.cfg.top_k,
                                                 provider.swiglu_limit)


# ---------------------------------------------------------------- norms, rotary, linear

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' *RMSNorm: statistics in fp32, the product in the input dtype. On CUDA, torch's fused
    kernel (fp32 statistics; the weight applied before the one rounding, so within a bf16 ulp of the
    two-rounding form): one launch instead of seven, which a decode step of ~100 norms notices."""
    if x.dtype == torch.float32 or x.is_cuda:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool):
    """(x + r, rms_norm(x + r)·weight): a residual add and the norm after it; `fused`: one Triton launch
    (x updated in place), else the two torch ops."""
    if fused:
        return x, triton_decode.add_rms_norm(x, r, weight, eps)
    x = x + r
    return x, rms_norm(x, weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim]; cos/sin [..., rotary_dim]. Partial rotary (GLM) rotates only the leading
    rotary_dim channels of each head and passes the rest through, as transformers' Glm4Moe does."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)


def rotary_tables(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, rotary_dim], computed in fp32 on the CPU exactly as transformers' default
    rope (inv_freq over the rotary dim; cat(freqs, freqs)) and then cast, so positions match bit for bit."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


class MLP(nn.Module):
    """SwiGLU MLP held by the model: dense layers and shared experts. gate and up are one matrix so a
    decode step reads them in one matmul."""

    def __init__(self, w: WeightSource, prefix: str):
        super().__init__()
        gate_up, down = [f"{prefix}.gate_proj", f"{prefix}.up_proj"], [f"{prefix}.down_proj"]
        # a GGUF's own blocks where it holds them (shared experts, dense layers), else the float weights
        self.gate_up = gguf_projection(w, gate_up) or Projection(torch.cat([w.get(f"{n}.weight") for n in gate_up]))
        self.down = gguf_projection(w, down) or Projection(w.get(f"{down[0]}.weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


# ---------------------------------------------------------------- routing helpers

def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype):
    """Qwen3-MoE / Mixtral: softmax over all experts in fp32, top-k, optional renormalisation."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(out_dtype)


def sigmoid_grouped_topk(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, n_group: int, topk_group: int,
                         renormalize: bool, scale: float, out_dtype: torch.dtype):
    """GLM-4.5 (DeepSeek-V3 style): sigmoid scores; the correction bias only steers *selection*;
    experts are chosen within the topk_group groups whose two best biased scores sum highest; the
    weights are the unbiased scores, renormalised, times routed_scaling_factor. fp32 throughout, the
    same op order as transformers' Glm4MoeTopkRouter (so ties break the same way)."""
    scores = logits.float().sigmoid()
    choice = scores + bias
    t, e = choice.shape
    if n_group > 1:
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, (weights * scale).to(out_dtype)


def layer_ahead_predictor(model: "MoEModel") -> Predictor:
    """The seed's layer-ahead routing, for a provider that prefetches (ExpertProvider.use_predictor): the next MoE
    layer's router applied to this layer's input predicts that layer's experts (softmax top-k of its router logits;
    the order of the logits, which is what a prediction needs, is the same under GLM's sigmoid)."""
    moe = sorted(model.cfg.moe_layers)
    nxt = {a: b for a, b in zip(moe, moe[1:])}
    top_k = model.cfg.top_k

    def predict(layer: int, x: torch.Tensor):
        if layer not in nxt:
            return None
        gate = model.layers[nxt[layer]].mlp.gate
        ids, _ = softmax_topk(F.linear(x.to(gate.dtype), gate), top_k, False, x.dtype)
        return nxt[layer], ids
    return predict


# ---------------------------------------------------------------- attention over the KV cache

# Attention on CUDA without cuDNN's kernel: it builds a plan for every new shape, 0.5 s for the first and ~90 ms each
# after on the H200 (results/2026-12-03-h200-prefill-kernels-2.json, the sdpa rows), so a prompt of a length not seen
# before paid it at every chunk (an 8000-token prompt in 512-token chunks: 1.45 s on a 4-layer model, 0.09 s once the
# shapes were known). Flash attention needs no plan; a later chunk's causal mask is its lower-right form (CausalBias).
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class Step:
    """Where one forward's tokens sit: built once per prefill/decode step, shared by every layer."""

    slots: list[int]
    sel: slice | torch.Tensor      # reads the batch's slots (a slice when contiguous: a view, no gather)
    idx: torch.Tensor              # [B] slot of each sequence, for decode writes
    positions: torch.Tensor        # [B, T] absolute position of each token
    start: int                     # prefill: first position written
    kv_len: int                    # keys to attend over (longest sequence in the batch)
    cos: torch.Tensor              # [B, T, 1, rotary_dim]
    sin: torch.Tensor
    mask: torch.Tensor | CausalBias | None   # [B, 1, T, kv_len] bool, or a CUDA prefill chunk's lower-right causal
                                   # bias, or None: a plain causal prefill / a decode that sees all
    decode: bool
    fused: bool = False            # a decode step on the fused kernels (MoEModel.fused_kernels)
    native: bool = False           # a one-sequence CPU decode step on engine.kernels.native (MoEModel.native_decode)
    scores: torch.Tensor | None = None   # native: the attention's scratch (MoEModel.scores)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None   # fused: the whole cos, sin tables [max_len, rotary_dim]


class Attention(nn.Module):
    """Multi-head attention with GQA, optional q/k RMSNorm per head (Qwen3, GLM use_qk_norm) and
    q/k/v(/o) biases when the checkpoint has them (GLM attention_bias, Qwen attention_bias)."""

    def __init__(self, cfg: ModelConfig, w: WeightSource, layer: int, kv: KVCache):
        super().__init__()
        p = f"model.layers.{layer}.self_attn"
        self.layer, self.kv, self.cfg = layer, kv, cfg
        # q, k, v as one matrix: one matmul per layer instead of three.
        self.split = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        biases = [w.maybe(f"{p}.{n}_proj.bias") for n in "qkv"]
        bqkv = None
        if any(b is not None for b in biases):
            some = next(b for b in biases if b is not None)
            bqkv = torch.cat([b if b is not None else some.new_zeros(n) for b, n in zip(biases, self.split)])
        self.qkv = dense_projection(w, [f"{p}.{n}_proj" for n in "qkv"], bqkv)
        self.o = dense_projection(w, [f"{p}.o_proj"], w.maybe(f"{p}.o_proj.bias"))
        self.q_norm = w.get(f"{p}.q_norm.weight") if cfg.use_qk_norm else None
        self.k_norm = w.get(f"{p}.k_norm.weight") if cfg.use_qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        # Both projections 4-bit blocks of one group size (the demo's --attention-blocks): natively the whole
        # attention half of a decode layer is one call (native.AttnBlock, made at the first native step).
        self.block_fits = (isinstance(self.qkv, Int4Projection) and isinstance(self.o, Int4Projection)
                           and self.q_norm is None and self.qkv.group == self.o.group
                           and max(self.qkv.in_features, self.o.in_features) <= native.MAX_K)
        # Else q|k|v and o as a GGUF's own blocks of other types (engine.gguf_tensors): one call too (GgmlAttnBlock).
        parts = getattr(self.qkv, "parts", [self.qkv])
        self.ggml_fits = (not self.block_fits and self.q_norm is None and isinstance(self.o, BlockProjection)
                          and all(isinstance(p, BlockProjection) for p in parts))
        self.block: native.AttnBlock | None = None

    def native_block(self, x: torch.Tensor, h: torch.Tensor, s: Step, post_norm: torch.Tensor) -> torch.Tensor:
        """The attention half of a native decode step (s.native): x += attention(h) in place → rms_norm(x)·post_norm."""
        if not (self.block_fits and native.int4_ok()) and not self.ggml_fits:
            return native.add_rms_norm(x, self.forward(h, s), post_norm, self.cfg.rms_eps)
        return self.native_attn_block()(x, h, s.slots[0], s.start, s.cos, s.sin, s.scores, post_norm)

    def native_attn_block(self) -> native.AttnBlock:
        if self.block is None:
            cfg = self.cfg
            make = (native.AttnBlock if self.block_fits else
                    lambda qkv, *a, **k: native.GgmlAttnBlock(getattr(qkv, "parts", [qkv]), *a, **k))
            self.block = make(self.qkv, self.o, self.kv.k[self.layer], self.kv.v[self.layer],
                                          window=cfg.sliding_window or 0, num_heads=cfg.num_heads,
                                          num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, scale=self.scale,
                                          eps=cfg.rms_eps)
        return self.block

    def native_rows(self, x: torch.Tensor, h: torch.Tensor, slot: int, start: int, cos: torch.Tensor,
                    sin: torch.Tensor, post_norm: torch.Tensor) -> torch.Tensor:
        """native_block on T tokens of one sequence at positions start.. (x, h [T, H]; cos/sin [T, rot]), each row
        as the one-token call computes it (MoEModel's exact prefill; block_fits only)."""
        return native.attn_block_rows(self.native_attn_block(), x, h, slot, start, cos, sin, post_norm)

    def forward(self, x: torch.Tensor, s: Step) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        qkv = self.qkv(x)
        if s.native and self.q_norm is None:    # one token: rotary, KV write and attention in one native call
            slot, p = s.slots[0], s.start
            o = native.attn_decode(qkv.view(-1), s.cos, s.sin, self.kv.k[self.layer, slot], self.kv.v[self.layer, slot],
                                   p, cfg.sliding_window or 0, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   self.scale, s.scores)
            return self.o(o).view(b, 1, -1)
        if s.fused:                   # one token per sequence: norm + rotary + KV write, then attention, fused
            k_cache, v_cache = self.kv.k[self.layer], self.kv.v[self.layer]
            pos = s.positions.view(-1)
            q = triton_decode.qk_rope_kv(qkv.view(b, -1), self.q_norm, self.k_norm, *s.rope, pos, s.idx, k_cache,
                                         v_cache, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                         head_dim=cfg.head_dim, eps=cfg.rms_eps)
            o = triton_decode.decode_attention(q, k_cache, v_cache, s.idx, pos, s.kv_len, scale=self.scale,
                                               window=cfg.sliding_window or 0)
            return self.o(o).view(b, 1, -1)
        heads = cfg.num_heads + cfg.num_kv_heads
        if self.q_norm is None:
            # q and k side by side in qkv: rotate them in one go (the same elementwise ops, half the calls)
            qk = apply_rotary(qkv[..., :heads * cfg.head_dim].view(b, t, heads, cfg.head_dim), s.cos, s.sin)
            q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=2)
            v = qkv[..., heads * cfg.head_dim:].view(b, t, cfg.num_kv_heads, cfg.head_dim)
        else:
            q, k, v = qkv.split(self.split, dim=-1)
            q = rms_norm(q.view(b, t, cfg.num_heads, cfg.head_dim), self.q_norm, cfg.rms_eps)
            k = rms_norm(k.view(b, t, cfg.num_kv_heads, cfg.head_dim), self.k_norm, cfg.rms_eps)
            v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
            q = apply_rotary(q, s.cos, s.sin)
            k = apply_rotary(k, s.cos, s.sin)
        if s.decode:
            self.kv.write_decode(self.layer, s.idx, s.positions[:, 0], k[:, 0], v[:, 0])
        else:
            self.kv.write_prefill(self.layer, s.slots[0], s.start, k[0], v[0])
        keys, values = self.kv.read(self.layer, s.sel, s.kv_len)
        with sdpa_kernel(CUDA_ATTENTION) if q.is_cuda else nullcontext():
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=s.mask,
                is_causal=s.mask is None and not s.decode, scale=self.scale, enable_gqa=cfg.kv_groups > 1)
        o = o.transpose(1, 2).reshape(b, t, cfg.num_heads * cfg.head_dim)
        return self.o(o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightSource, layer: int, kv: KVCache, mlp: nn.Module):
        super().__init__()
        p = f"model.layers.{layer}"
        self.eps = cfg.rms_eps
        self.input_norm = w.get(f"{p}.input_layernorm.weight")
        self.post_norm = w.get(f"{p}.post_attention_layernorm.weight")
        self.attn = Attention(cfg, w, layer, kv)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, h: torch.Tensor, s: Step, next_norm: torch.Tensor):
        """x the residual stream, h = input_norm(x) → (x', next_norm(x')): each residual add is fused with the
        norm that follows it (the next layer's input norm, or the model's final norm)."""
        x, h = add_rms_norm(x, self.attn(h, s), self.post_norm, self.eps, s.fused)
        return add_rms_norm(x, self.mlp(h.view(-1, h.shape[-1])).view_as(h), next_norm, self.eps, s.fused)


# ---------------------------------------------------------------- the model

class MoEModel(nn.Module):
    """The shared skeleton; an architecture supplies build_mlp(layer) (dense MLP or its MoE block)."""

    bench_routing = None       # engine.routing_trace.BenchRouting where the loader installed one (benchmarking only)

    def __init__(self, cfg: ModelConfig, w: WeightSource, provider: ExpertProvider, kv: KVCache, *,
                 device, dtype: torch.dtype, fused_kernels: bool = True, native_kernels: bool = True,
                 int8_activations: bool = False):
        super().__init__()
        self.cfg, self.provider, self.kv = cfg, provider, kv
        self.device, self.dtype = torch.device(device), dtype
        # Decode on the fused Triton kernels where they run (CUDA) and fit the shapes; off
        # (EngineConfig.fused_kernels) for the torch forms, the A/B baseline. Set before the blocks are built.
        self.fused_kernels = (fused_kernels and triton_decode.serves_on(self.device)
                              and triton_decode.attention_ok(cfg.head_dim, cfg.rotary_dim, cfg.hidden))
        # One-sequence CPU decode steps on engine.kernels.native (EngineConfig.native_kernels) where it builds and
        # the model fits it (float32, no q/k norm, heads of at most 512): the torch forms' function in a few calls.
        self.native_kernels = native_kernels and self.device.type == "cpu" and native.lib() is not None
        # EngineConfig.cpu_activations "int8": the native GGUF GEMVs round x to 8 bits in this model's passes
        # (engine.loader refuses it where the native kernels are off or not built).
        self.int8_activations = int8_activations and self.native_kernels
        self.native_decode = (self.native_kernels and dtype == torch.float32 and not cfg.use_qk_norm
                              and cfg.head_dim <= 512)
        # native: the attention's scores, one row per head over the whole cache
        self.scores = torch.empty(cfg.num_heads * kv.max_len) if self.native_decode else None
        self._native_layers: list | None = None      # _run_native's walk, made at its first step
        self._step_layers: native.DecodeLayers | bool | None = None   # the walk in one call (_decode_layers)
        self._exact_prefill: bool | None = None      # exact_prefill, decided at the first prefill
        self.norm = w.get("model.norm.weight")
        kept = self._gguf_vocabulary(w) if self.device.type == "cpu" else None
        if kept is not None:            # a GGUF's own blocks: the head's (and the embedding's rows where quantized)
            self.head, self.rows_from = kept
            self.lm_head = None
            self.embed = w.get("model.embed_tokens.weight") if self.rows_from is None else None
        elif self.device.type != "cpu" and getattr(w, "gpu_blocks", True) \
                and (gpu_head := gguf_projection(w, ["lm_head"])) is not None and not isinstance(gpu_head, Projection):
            # A GGUF's untied output on the GPU: its blocks (engine.gguf_tensors.DeviceBlockProjection: a Q6_K head
            # reads 6.6 bits a weight a token, not bf16's 16); the embedding's rows as floats.
            self.head, self.lm_head, self.rows_from = gpu_head, None, None
            self.embed = w.get("model.embed_tokens.weight")
        else:
            self.embed = w.get("model.embed_tokens.weight")
            head = w.maybe("lm_head.weight")
            self.lm_head = head if head is not None else self.embed       # tie_word_embeddings
            # Natively, a vocabulary that is exactly 8-bit blocks (a GGUF's Q8_0, dequantized by engine convert) is
            # held as them: 3.8x fewer bytes a token than float32, the same values (Q8Projection.exact checks).
            q8 = Q8Projection.exact(self.lm_head) if self.native_decode else None
            self.head = self.rows_from = q8 or Projection(self.lm_head)   # on the CPU a transposed copy (tied or not)
            if head is None and q8 is not None:
                self.embed = self.lm_head = None             # the embedding reads its rows from the blocks (q8.rows)
            elif head is None and self.head.cpu:
                # Tied on the CPU: the embedding reads its rows from that copy (the same values), so the vocabulary
                # is held once, not twice (113 MB of SmolLM2's fp32 RSS; bench/demo_memory.py).
                self.embed = self.lm_head = self.head.weight.t()
        moe = set(cfg.moe_layers)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, w, l, kv, self.build_moe(w, l) if l in moe else self.build_dense(w, l))
            for l in range(cfg.num_layers))
        self.cos, self.sin = rotary_tables(cfg, kv.max_len, dtype, self.device)
        self.graphs = None              # engine.gpu.graphs.DecodeGraphs once use_cuda_graphs() is on
        if self.fused_kernels:          # at load, not in the first long stream: Triton compiles each bucket's variant
            t0, buckets = time.perf_counter(), kv_buckets(kv.max_len)
            n = triton_decode.warm_attention(kv.k[0], kv.v[0], buckets, num_heads=cfg.num_heads,
                                             scale=cfg.head_dim ** -0.5, window=cfg.sliding_window or 0)
            log.info("decode attention: %d variants for %d KV buckets ready in %.1f s", n, len(buckets),
                     time.perf_counter() - t0)

    @staticmethod
    def _gguf_vocabulary(w: WeightSource):
        """(head, embedding) from a GGUF's own blocks: the output's (untied: a Q4_K_M's Q6_K) or token_embd's
        (tied), and token_embd's blocks giving the embedding's rows (.rows; None where the file holds it as floats);
        None where neither is quantized or the checkpoint is not a GGUF."""
        embed = gguf_projection(w, ["model.embed_tokens"], rows=True)
        head = gguf_projection(w, ["lm_head"])
        if head is None and embed is None:
            return None
        if head is None:
            floats = w.maybe("lm_head.weight")
            head = embed if floats is None else Projection(floats)
        return head, embed

    # per-architecture caches and blocks
    @staticmethod
    def caches_for(config: dict, cfg: ModelConfig, slots: int, max_len: int, *, dtype, device,
                   where: str = "config") -> KVCache:
        """The model's own caches, sized for `slots` sequences of `max_len` tokens, allocated once by the loader.
        The scheduler (engine.scheduler) only hands out and frees their slots (engine.kv_cache.SlotCaches), so an
        architecture with other layer kinds declares its caches here (engine.models.glm5_next) and nothing else
        special-cases them. Here: one standard KV cache."""
        return KVCache(cfg.num_layers, slots, max_len, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)

    @property
    def caches(self) -> KVCache:
        return self.kv

    def build_moe(self, w: WeightSource, layer: int) -> nn.Module:
        raise NotImplementedError

    def build_dense(self, w: WeightSource, layer: int) -> nn.Module:
        return MLP(w, f"model.layers.{layer}.mlp")

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    def _run(self, ids: torch.Tensor, s: Step) -> torch.Tensor:
        x = F.embedding(ids, self.embed) if self.embed is not None else self.rows_from.rows(ids)
        if s.native:
            return self._run_native(x, s)
        h = rms_norm(x, self.layers[0].input_norm, self.cfg.rms_eps)
        for i, layer in enumerate(self.layers):
            last = i + 1 == len(self.layers)
            x, h = layer(x, h, s, self.norm if last else self.layers[i + 1].input_norm)
        return h

    def _run_native(self, x: torch.Tensor, s: Step) -> torch.Tensor:
        """DecoderLayer.forward's function on the native kernels, the layers walked without nn.Module's call
        machinery: x, the step's own residual stream, is updated in place; each h is new."""
        eps = self.cfg.rms_eps
        h = native.add_rms_norm(x, None, self.layers[0].input_norm, eps)
        if (step := self._decode_layers()) is not None:
            return self._run_decode_layers(step, x, h, s)
        for attn, post_norm, mlp, next_norm in self._native_walk():
            h = attn.native_block(x, h, s, post_norm)
            if getattr(mlp, "tail", None) is None or (h_next := mlp.native_step(x, h, next_norm, eps)) is None:
                h_next = native.add_rms_norm(x, mlp.forward(h.view(1, -1)), next_norm, eps)
            h = h_next
        return h

    @property
    def exact_prefill(self) -> bool:
        """Prefill runs the one-token decode step's native kernels row by row (_prefill_rows), so a position's keys,
        values and logits have the same bits from a whole prefill, a chunk of another length or a decode step: what
        makes the prefix cache change no output. Where a native decode step is one call per attention half (4-bit
        attention blocks: AttnBlock) and one per MoE half (MoETail): the demo's quantized path. Elsewhere prefill
        keeps the torch forms (the same function, other roundings)."""
        if self._exact_prefill is None:
            self._exact_prefill = (self.native_decode and native.int4_ok()
                                   and all(layer.attn.block_fits and getattr(layer.mlp, "tail", None) is not None
                                           and layer.mlp.tail.rows
                                           for layer in self.layers))
        return self._exact_prefill

    def _one_call_halves(self) -> bool:
        """Every layer's halves are the one-call kinds: its attention an AttnBlock (4-bit blocks) or a GgmlAttnBlock
        (a GGUF's own blocks), its MoE half a MoETail, or a GgmlTail in every layer (a GGUF's mixed-type records)."""
        tails = [getattr(layer.mlp, "tail", None) for layer in self.layers]
        return (self.native_decode and all(t is not None for t in tails)
                and len({isinstance(t, native.GgmlTail) for t in tails}) == 1
                and all((layer.attn.block_fits and native.int4_ok()) or layer.attn.ggml_fits for layer in self.layers))

    def _decode_layers(self) -> native.DecodeLayers | None:
        """The whole walk of _run_native in one native call (native.DecodeLayers), where every layer's halves are
        the one-call kinds (_one_call_halves: the demo's AttnBlock and MoETail, or a GGUF's GgmlAttnBlock and
        GgmlTail), its router a plain softmax top-k (MoE blocks with `renormalize`) and the provider hands out a
        table of its host records; else None (the walk above). Decided at the first native step."""
        if self._step_layers is None:
            blocks = [layer.mlp for layer in self.layers]
            ok = (self._one_call_halves()
                  and self.provider.host_record_table(len(self.layers), self.cfg.top_k) is not None
                  and all(getattr(b, "renormalize", None) is not None and b.layer == i and b.gate.is_contiguous()
                          for i, b in enumerate(blocks))
                  and len({b.renormalize for b in blocks}) == 1)
            walk = self._native_walk()
            self._step_layers = native.DecodeLayers(
                [a.native_attn_block() for a, *_ in walk], [b.tail for b in blocks], [w[1] for w in walk],
                [b.gate for b in blocks], [w[3] for w in walk], self.cfg.n_experts,
                blocks[0].renormalize) if ok else False
        return self._step_layers or None

    def _run_decode_layers(self, step: native.DecodeLayers, x: torch.Tensor, h: torch.Tensor, s: Step) -> torch.Tensor:
        """_run_native's walk in native.DecodeLayers' calls: the provider books the layers' picks after the call
        (book_host_records: what host_records does, in layer order, as the walk's calls would), and a layer whose
        records are not resident comes back here to be fetched (booked first, so the RAM tier evicts as the walk
        would) and resumed."""
        provider, n = self.provider, len(self.layers)
        start, booked, resume = 0, 0, False
        while True:
            stop = step(x, h, provider.host_record_table(n, self.cfg.top_k), start, resume, s.slots[0], s.start,
                        s.cos, s.sin, s.scores)
            ids = step.ids.tolist()
            provider.book_host_records(booked, ids[booked:stop])
            if stop == n:
                return h
            provider.host_records(stop, ids[stop])       # a miss: read into the RAM tier, then resume there
            start, booked, resume = stop, stop + 1, True

    def _native_walk(self) -> list:
        if self._native_layers is None:
            layers = self.layers
            norms = [layer.input_norm for layer in layers[1:]] + [self.norm]
            self._native_layers = [(layer.attn, layer.post_norm, layer.mlp, n) for layer, n in zip(layers, norms)]
        return self._native_layers

    def _prefill_rows(self, ids: torch.Tensor, slot: int, start: int) -> torch.Tensor:
        """_run_native's function on T tokens of one sequence (ids [1, T]) at positions start..: every row through
        the same kernels a decode step runs, the rows of a layer in one call each (exact_prefill) → h [T, H]."""
        t = ids.shape[1]
        x = (F.embedding(ids, self.embed) if self.embed is not None else self.rows_from.rows(ids)).view(t, -1).contiguous()
        eps = self.cfg.rms_eps
        cos, sin = self.cos[start:start + t], self.sin[start:start + t]
        h = native.add_rms_norm_rows(x, None, self.layers[0].input_norm, eps)
        for attn, post_norm, mlp, next_norm in self._native_walk():
            h = attn.native_rows(x, h, slot, start, cos, sin, post_norm)
            h_next = mlp.native_rows(x, h, next_norm, eps)
            if h_next is None:        # the provider computes the experts: each row as a decode step's fallback does
                h_next = torch.stack([native.add_rms_norm(x[i], mlp.forward(h[i].view(1, -1)), next_norm, eps)
                                      for i in range(t)])
            h = h_next
        return h

    def _mask(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[B, 1, T, kv_len]: key j is visible to a query at position p iff j <= p (and within the window)."""
        j = torch.arange(kv_len, device=positions.device)
        p = positions[:, None, :, None]
        mask = j <= p
        if self.cfg.sliding_window:
            mask &= j > p - self.cfg.sliding_window
        return mask

    def prefill(self, ids, slot: int, start: int = 0, all_logits: bool = False) -> torch.Tensor:
        """Run one sequence's tokens `ids` into `slot` at positions start..; logits of the last token [V]
        (or of every token [T, V])."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        t = ids.shape[1]
        assert t > 0 and start + t <= self.max_len, f"{start}+{t} tokens exceed the KV cache's {self.max_len}"
        if self.exact_prefill:
            with native.allow(self.native_kernels, self.int8_activations):
                h = self._prefill_rows(ids, slot, start)
                if not all_logits:
                    return self.head(h[-1])
                if isinstance(self.head, Q8Projection):
                    return self.head(h)                  # its rows kernel: each row as the one-row GEMV
                return torch.stack([self.head(row) for row in h])     # a float head: each row as decode's one row
        sel, idx = select([slot], self.device)
        kv_len = start + t
        positions = torch.arange(start, kv_len, device=self.device).view(1, t)
        windowed = bool(self.cfg.sliding_window and kv_len > self.cfg.sliding_window)
        if start == 0 and not windowed:
            mask = None                                   # plain causal
        elif self.device.type == "cuda" and not windowed:
            from torch.nn.attention.bias import causal_lower_right     # imports triton: CUDA only (a CPU serve's RSS)
            mask = causal_lower_right(t, kv_len)          # query i sees keys up to start + i: flash, no dense mask
        else:
            mask = self._mask(positions, kv_len)
        s = Step(slots=[slot], sel=sel, idx=idx, positions=positions, start=start, kv_len=kv_len,
                 cos=self.cos[start:kv_len].view(1, t, 1, -1), sin=self.sin[start:kv_len].view(1, t, 1, -1),
                 mask=mask, decode=False)
        with native.allow(self.native_kernels, self.int8_activations):
            h = self._run(ids, s)[0]
            return self.head(h if all_logits else h[-1])

    def use_cuda_graphs(self) -> bool:
        """Replay decode steps from CUDA graphs (engine.gpu.graphs) where the device and the expert provider
        allow it: a CUDA device and a graph-capturable provider. → whether decode_step now does."""
        if self.device.type != "cuda" or not self.provider.graph_capturable:
            return False
        self.graphs = DecodeGraphs(self)
        return True

    @property
    def async_decode(self) -> bool:
        """decode_step returns before the device has computed the step (CUDA, and a provider with no host step
        inside it: resident), so the host can do other work until it reads the logits."""
        return self.device.type == "cuda" and not self.provider.host_steps

    @property
    def decode_ahead_ok(self) -> bool:
        """A step may launch before the last one's logits are read (engine.llm's decode ahead): launches are
        asynchronous and the provider has no hook between steps (zero-copy's routing log and promotions read each
        step's log once its logits are read)."""
        return self.async_decode and not self.provider.decode_hooks

    def decode_meta(self, slots: list[int], sel, idx: torch.Tensor, pos: torch.Tensor, kv_len: int) -> Step:
        """A decode step's Step (eager and graph-captured decode build it here alike). pos [B, 1]."""
        b = pos.shape[0]
        cuda = self.device.type == "cuda"
        if self.fused_kernels:        # the kernels read the tables at each position and bound keys themselves
            return Step(slots=slots, sel=sel, idx=idx, positions=pos, start=0, kv_len=kv_len, cos=None, sin=None,
                        mask=None, decode=True, fused=True, rope=(self.cos, self.sin))
        if self.native_decode and b == 1:     # start: the token's position; cos, sin: its rows
            p = kv_len - 1
            return Step(slots=slots, sel=sel, idx=idx, positions=pos, start=p, kv_len=kv_len, cos=self.cos[p],
                        sin=self.sin[p], mask=None, decode=True, native=True, scores=self.scores)
        # One sequence sees every key read (unless a sliding window hides some): no mask to apply. On CUDA
        # always a mask, so eager and graph decode compute the same thing.
        sees_all = (not cuda and b == 1 and not (self.cfg.sliding_window and kv_len > self.cfg.sliding_window))
        return Step(slots=slots, sel=sel, idx=idx, positions=pos, start=0, kv_len=kv_len,
                    cos=self.cos[pos].view(b, 1, 1, -1), sin=self.sin[pos].view(b, 1, 1, -1),
                    mask=None if sees_all else self._mask(pos, kv_len), decode=True)

    def decode_step(self, tokens, slots: list[int], positions: list[int]) -> torch.Tensor:
        """One token per sequence: tokens [B] go to (slots[b], positions[b]); logits [B, V]. A provider's hooks
        (TieredExperts' zero-copy decode: its record table, routing log, promotions) run around the launch."""
        b = len(slots)
        assert b == len(positions) and max(positions) < self.max_len, "decode position beyond the KV cache"
        self.provider.before_decode()
        logits = self._decode_launch(tokens, slots, positions)
        self.provider.after_decode_launch(b * self.cfg.top_k)      # while the device computes the step
        return logits

    def decode_picks(self, tokens, slots: list[int], positions: list[int], rows: list[RowSpec],
                     penalties: Penalties | None = None) -> tuple[torch.Tensor, Picks]:
        """decode_step, and its tokens for `rows` chosen on the device without a host read: by the sampler graph
        replayed after the step's CUDA graph (engine.gpu.graphs.decode_sampled) where one replays this step, else
        by engine.sampling.sample after decode_step. A penalised row needs its slot's counts (`penalties`)."""
        b = len(slots)
        if self.graphs is not None and self.graphs.usable(b) and mode(rows, penalties is not None) is not None:
            assert b == len(positions) and max(positions) < self.max_len, "decode position beyond the KV cache"
            self.provider.before_decode()
            logits, drawn = self.graphs.decode_sampled(tokens, slots, positions, rows, penalties)
            self.provider.after_decode_launch(b * self.cfg.top_k)
            return logits, Picks(logits, rows, drawn=drawn)
        logits = self.decode_step(tokens, slots, positions)
        return logits, Picks(logits, rows, penalties=penalties,
                             slots=None if penalties is None else torch.tensor(slots, device=logits.device))

    def _decode_launch(self, tokens, slots: list[int], positions: list[int]) -> torch.Tensor:
        b = len(slots)
        if self.graphs is not None and self.graphs.usable(b):
            return self.graphs.decode(tokens, slots, positions)
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(b, 1)
        pos = torch.tensor(positions, device=self.device).view(b, 1)
        sel, idx = select(slots, self.device)
        kv_len = max(positions) + 1
        if self.device.type == "cuda":
            # A new key length every step would make cuDNN attention build a plan per step (~ms each), and a
            # fused attention a grid per step: the graphs' buckets.
            kv_len = kv_bucket(kv_len, self.max_len)
        s = self.decode_meta(slots, sel, idx, pos, kv_len)
        with native.allow(self.native_kernels, self.int8_activations):
            return self.head(self._run(ids, s)[:, 0])                   # one row: lm_head's column halves on two threads

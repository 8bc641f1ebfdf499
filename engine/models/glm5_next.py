"""GLM-5.3-Flash (transformers' glm5_next text model): mHC residual streams around every block, KDA linear
attention and DSA (MLA + a pooled top-k indexer) layers in the config's order, dense MLP layers then MoE layers
(sigmoid routing as GLM-4.5, a shared expert, SwiGLU clamped at swiglu_limit: the routed experts' too).

Every layer reads and writes the residual as `hc_mult` streams: a hyper connection collapses them into the block's
input (weights `pre`), expands the block's output back (`post`) and mixes the old streams in (`comb`, made doubly
stochastic by Sinkhorn iterations); the model's output is the plain mean of the streams.

Caches (Glm5Caches, one slot per sequence, allocated once from the recipe's context and batch): a KDA layer keeps a
recurrent state and a conv state per sequence (constant size); a DSA layer keeps the MLA latent per token
(kv_lora_rank: the normalised compressed KV, never the expanded K/V) and, where it runs its own indexer, the
indexer's key and pool-gate score per token.

Which reference is the definition: a full UNCACHED forward of the same tokens. Kiln's cached decode equals it at
every position (tests/engine/test_glm5_next.py). transformers' own cached decode departs from its uncached forward
where candidate pools score exactly the same: the indexer's score is a weighted sum of ReLU'd dot products, so
pools that every indexer head scores below zero get exactly 0.0 (common with few heads, or early in training), and
tie. transformers (and llama.cpp's glm5-next, whose `ggml_top_k` is documented UNORDERED) choose among ties in
torch.topk's (ggml's) order, which depends on how many candidate pools the row holds: a decode step's row has the
pools completed so far, an uncached forward's row every pool of the sequence. So the choice flips when the
candidate count changes, first at the first pool completed after the prompt (the 44th token of a 40-token prompt
with index_kpool 4), and the logits differ from there by O(1); even transformers' uncached forward of a prefix
differs from its forward of the whole sequence at those positions. Kiln breaks ties by the lower pool index (a
stable sort), which does not depend on the row's length: cached and uncached agree wherever scores tie, and equal
transformers wherever they do not.

On CUDA the static decode step (decode_static, and so the captured graphs) runs engine.kernels.triton_glm5's fused
kernels for the mHC mixing, KDA, the MLA (over the latent, kv_b absorbed) and the indexer's scores (Glm5Next.fused,
chosen at load); the torch forms here are their reference, and the CPU's path.
"""
from __future__ import annotations

from dataclasses import dataclass

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import CheckpointError
from engine.model_config import ModelConfig
from engine.experts.provider import ExpertProvider
from engine.glm5_next_config import DSA, KDA, Glm5Spec, SpecError, tensor_shapes
from engine.kv_cache import SlotCaches, kv_bucket, kv_buckets, untouched_zeros
from engine.models.common import MLP, WeightSource, rms_norm, sigmoid_grouped_topk
from engine.routing_trace import RoutedBlock
from engine.dense_weights import Projection
from engine.kernels import triton_decode, triton_glm5
from engine.gpu.graphs import DecodeGraphs

log = logging.getLogger("engine.models")

KDA_CHUNK = 64          # transformers' chunk_kimi_delta_attention chunk size
SNAPSHOTS = 3           # KDA state snapshots a slot keeps (Glm5Caches): prompt's last block, branch point, decode's latest
KDA_GROUP_BYTES = 256 << 20     # kda_chunked's per-chunk decay tensors, made this many bytes of chunks at a time
# DSA prefill: queries selected and attended at a time (masks, scores [queries, keys]); the scheduler's CUDA prefill
# (4 chunks of 512) runs as one block, a whole long prompt in blocks
PREFILL_QUERIES = 2048


# ---------------------------------------------------------------- caches

class Glm5Caches(SlotCaches):
    """Each layer kind's own cache, slot per sequence: KDA recurrent [heads, dk, dv] + conv [3·qkv, kernel-1]
    states (fp32, as transformers keeps them), the MLA latent [max_len, kv_lora_rank] and the indexer's key and
    pool-gate score [max_len, 2·index_head_dim] per token (model dtype).

    Prefix reuse (engine.prefix_cache): the latent and indexer rows are positional, valid for any prefix; the KDA
    states are not (a delta-rule state cannot be cut back), so a slot is resumable only at positions where it kept
    a snapshot of them: SNAPSHOTS per slot, each every KDA layer's recurrent and conv state at one block boundary.
    Which ones: those the prefix cache asks for as a prefill passes them (keep_at: the prompt's last whole block,
    and where it branched off another prompt), and the latest boundary its decode crossed, so a chat's next turn
    resumes after the last reply. A full slot drops the lowest-positioned snapshot an earlier sequence left, then
    its own lowest. At GLM-5.3-Flash's shape (34 KDA layers, 64 heads of 128) one snapshot is
    34 × (64·128·128 + 3·8192·3) × 4 B = 145.6 MiB, as much as the slot's own live state; SNAPSHOTS of them per
    slot, allocated only when the prefix cache is on (prepare_reuse; on the CPU as untouched pages)."""

    reusable_prefix = True

    def __init__(self, spec: Glm5Spec, slots: int, max_len: int, *, dtype: torch.dtype, device):
        super().__init__(slots, max_len)
        self.spec = spec
        kda = [i for i, t in enumerate(spec.layer_types) if t == KDA]
        dsa = [i for i, t in enumerate(spec.layer_types) if t == DSA]
        full = [i for i in dsa if spec.indexer_types[i] == "full"]
        self.row = {l: j for ls in (kda, dsa) for j, l in enumerate(ls)} | {("idx", l): j for j, l in enumerate(full)}
        hd = spec.linear_head_dim
        self.state = torch.zeros(len(kda), slots, spec.linear_heads, hd, hd, dtype=torch.float32, device=device)
        self.conv = torch.zeros(len(kda), slots, 3 * spec.qkv_dim, spec.conv_kernel - 1, dtype=torch.float32,
                                device=device)
        self.latent = untouched_zeros((len(dsa), slots, max_len, spec.kv_lora_rank), dtype, device)
        self.index = untouched_zeros((len(full), slots, max_len, 2 * spec.index_head_dim), dtype, device)
        self.block = 0                  # the prefix cache's block; 0: it is off, and no snapshot is kept
        self.snap_state = self.snap_conv = None

    @property
    def nbytes(self) -> int:
        kept = [t for t in (self.snap_state, self.snap_conv) if t is not None]
        return sum(t.numel() * t.element_size() for t in [self.state, self.conv, self.latent, self.index] + kept)

    def reset(self, slot: int) -> None:
        # The recurrent states carry a sequence forward; the latent and indexer rows are read only up to its length.
        # Its snapshots stay: they hold the prefix the prefix cache may hand the slot's next sequence.
        self.state[:, slot].zero_()
        self.conv[:, slot].zero_()

    # --- decode ahead: a redone step would advance the KDA states twice, so a launch ahead keeps them first ---
    def hold(self, slots: list[int]) -> None:
        # A device copy queued behind the step before it (no host read): 145.6 MiB a slot at GLM-5.3-Flash's shape.
        self._held = (list(slots), self.state[:, slots].clone(), self.conv[:, slots].clone())

    def undo(self, slots: list[int]) -> None:
        held, self._held = getattr(self, "_held", None), None
        if held is None:
            return
        kept, state, conv = held
        rows = [i for i, s in enumerate(kept) if s in set(slots)]
        if rows:
            back = [kept[i] for i in rows]
            self.state[:, back] = state[:, rows]
            self.conv[:, back] = conv[:, rows]

    # --- snapshots of the KDA states at block boundaries (prefix reuse) ---
    def prepare_reuse(self, block: int, snapshots: int = SNAPSHOTS) -> None:
        self.block = block
        dev = self.state.device
        self.snap_state = untouched_zeros((self.state.shape[0], self.slots, snapshots) + self.state.shape[2:],
                                          torch.float32, dev)
        self.snap_conv = untouched_zeros((self.conv.shape[0], self.slots, snapshots) + self.conv.shape[2:],
                                         torch.float32, dev)
        self._at = [[None] * snapshots for _ in range(self.slots)]   # the position each snapshot is of
        self._own = [set() for _ in range(self.slots)]      # the snapshots the slot's current sequence took
        self._wanted: list[set[int]] = [set() for _ in range(self.slots)]
        self._decoded: list[int | None] = [None] * self.slots    # its decode's latest snapshot

    def resumable(self, slot: int, n: int) -> int:
        return max((p for p in self._at[slot] if p is not None and p <= n), default=0)

    def kept(self, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """position → the slot's snapshot there: (recurrent, conv) states of every KDA layer."""
        return {p: (self.snap_state[:, slot, j], self.snap_conv[:, slot, j])
                for j, p in enumerate(self._at[slot]) if p is not None}

    def resume(self, slot: int, n: int) -> None:
        self._start(slot, n)
        if n:
            j = self._at[slot].index(n)
            self.state[:, slot] = self.snap_state[:, slot, j]
            self.conv[:, slot] = self.snap_conv[:, slot, j]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions 0..n of slot `src` into `dst`, the KDA states from src's snapshot at n (into dst's live
        states, and as dst's own snapshot at n: the prefix stays resumable there once src's is gone)."""
        j = self._at[src].index(n)
        self.latent[:, dst, :n] = self.latent[:, src, :n]
        self.index[:, dst, :n] = self.index[:, src, :n]
        self._start(dst, 0)
        self._at[dst][0] = n
        for live, kept in ((self.state, self.snap_state), (self.conv, self.snap_conv)):
            kept[:, dst, 0] = kept[:, src, j]
            live[:, dst] = kept[:, src, j]

    def keep_at(self, slot: int, positions: set[int]) -> None:
        self._wanted[slot] = set(positions)

    def snapshot_points(self, slot: int, start: int, end: int) -> list[int]:
        """The positions in (start, end] a prefill of that span of `slot` keeps the KDA states at, ascending."""
        return sorted(p for p in self._wanted[slot] if start < p <= end) if self.block else []

    def snapshot(self, slot: int, at: int, decode: bool = False) -> None:
        """Every KDA layer's live states of `slot`, which are at position `at`, into a snapshot of the slot: decode's
        own one (replaced as decode goes on), else a new one. A device copy queued behind the work before it, no
        host read: after a decode step it runs outside the step's captured graph, behind its replay."""
        at_ = self._at[slot]
        if decode and self._decoded[slot] is not None:
            j = self._decoded[slot]
        elif at in at_:
            j = at_.index(at)
        else:
            j = self._victim(slot)
            self._own[slot].add(j)
            if decode:
                self._decoded[slot] = j
        at_[j] = at
        self.snap_state[:, slot, j] = self.state[:, slot]
        self.snap_conv[:, slot, j] = self.conv[:, slot]

    def after_decode(self, slots: list[int], positions: list[int]) -> None:
        """After a decode step is launched (eager or a graph's replay): a sequence whose token was a block's last
        keeps its states at the boundary."""
        if self.block:
            for slot, pos in zip(slots, positions):
                if (pos + 1) % self.block == 0:
                    self.snapshot(slot, pos + 1, decode=True)

    def _start(self, slot: int, n: int) -> None:
        """A new sequence in `slot` goes on from its first n positions: the snapshots past n are of another's."""
        self._at[slot] = [p if p is not None and p <= n else None for p in self._at[slot]]
        self._own[slot], self._wanted[slot], self._decoded[slot] = set(), set(), None

    def _victim(self, slot: int) -> int:
        """The snapshot a new one replaces: a free one, else the lowest an earlier sequence left, else the lowest."""
        at = self._at[slot]
        return min(range(len(at)), key=lambda j: (at[j] is not None, j in self._own[slot], at[j] or 0))


# ---------------------------------------------------------------- blocks

class ClampedMLP(MLP):
    """Glm5NextTextMLP: SwiGLU with gate clamped from above and up clamped both ways at swiglu_limit."""

    def __init__(self, w: WeightSource, prefix: str, limit: float):
        super().__init__(w, prefix)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down(F.silu(gate) * up)


class Glm5MoeBlock(RoutedBlock):
    """Routed experts through the provider (as every architecture) plus the shared expert; routing as GLM-4.5.
    The routed experts' gate and up are clamped at swiglu_limit as the shared expert's are: the model hands the
    limit to its provider at load (ExpertProvider.use_swiglu_limit), which carries it into every expert kernel."""

    def __init__(self, model: "Glm5Next", w: WeightSource, layer: int):
        super().__init__()
        p, c = f"model.layers.{layer}.mlp", model.cfg
        self.layer, self.provider, self.cfg, self.top_k = layer, model.provider, c, c.top_k
        self.gate = w.get(f"{p}.gate.weight", fp32=True)
        self.bias = w.get(f"{p}.gate.e_score_correction_bias", fp32=True)
        self.shared = ClampedMLP(w, f"{p}.shared_experts", model.spec.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        ids, weights = sigmoid_grouped_topk(F.linear(x.float(), self.gate), self.bias, top_k=c.top_k,
                                            n_group=c.n_group, topk_group=c.topk_group, renormalize=c.norm_topk_prob,
                                            scale=c.routed_scaling_factor, out_dtype=x.dtype)
        return self.provider.forward(self.layer, x, self.pick(ids), weights) + self.shared(x)


class HyperConnection:
    """mHC (Glm5NextTextHyperConnection): from the streams [N, hc, H] → (post [N, hc], comb [N, hc, hc], the
    collapsed block input [N, H]); all weights in fp32."""

    def __init__(self, w: WeightSource, prefix: str, spec: Glm5Spec, eps: float):
        self.fn = w.get(f"{prefix}_fn", fp32=True)
        self.base = w.get(f"{prefix}_base", fp32=True)
        self.scale = w.get(f"{prefix}_scale", fp32=True)
        self.hc, self.iters, self.hc_eps, self.eps = spec.hc_mult, spec.hc_sinkhorn_iters, spec.hc_eps, eps

    def __call__(self, streams: torch.Tensor, fused: bool = False):
        if fused:                       # one token per sequence on CUDA: the same function in two launches
            return triton_glm5.hc_pre(streams, self.fn, self.base, self.scale, iters=self.iters, hc_eps=self.hc_eps,
                                      eps=self.eps)
        hc, n = self.hc, streams.shape[0]
        flat = streams.reshape(n, -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn).split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(n, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The block's output expanded by post plus the old streams mixed by comb: [N, hc, H]."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@dataclass
class Segment:
    """One sequence's run of tokens in a step: rows [row, row + length) of the step's tokens, at positions
    start.. of cache slot `slot`."""

    slot: int
    start: int
    row: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class StaticDecode:
    """A decode step of fixed shapes and no host read (what Glm5DecodeGraphs captures): one token for each of B
    sequences, at cache slots idx [B] and positions pos [B] (device tensors), the indexer scoring the pools of the
    first kv_len keys (a bucket, engine.kv_cache.kv_bucket, ≥ every position + 1) and every sequence attending a
    fixed-size set of index_topk + index_kpool keys, masked."""

    idx: torch.Tensor
    pos: torch.Tensor
    kv_len: int


def query_blocks(segments: list[Segment]):
    """Each segment's queries as consecutive segments of at most PREFILL_QUERIES tokens."""
    for s in segments:
        for o in range(0, s.length, PREFILL_QUERIES):
            yield Segment(s.slot, s.start + o, s.row + o, min(PREFILL_QUERIES, s.length - o))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)    # as FLA's (and transformers') l2norm


def kda_recurrent(q, k, v, g, beta, state):
    """The gated delta rule token by token. q, k [T, *B, Hh, dk] (l2-normed, q scaled), v [T, *B, Hh, dv],
    g [T, *B, Hh, dk] (log decay), beta [T, *B, Hh], state [*B, Hh, dk, dv] fp32 → (out [T, *B, Hh, dv], state);
    *B: no dims (one sequence) or a batch of sequences, one token each (decode)."""
    out = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    for i in range(q.shape[0]):
        state = state * g[i].exp()[..., None]
        kv_mem = (state * k[i][..., None]).sum(dim=-2)
        delta = (v[i] - kv_mem) * beta[i][..., None]
        state = state + k[i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[i] = (state * q[i].unsqueeze(-1)).sum(dim=-2)
    return out, state


def kda_chunked(q, k, v, g, beta, state, chunk: int = KDA_CHUNK):
    """The same function in transformers' chunked form (chunk_kimi_delta_attention), for prefill: the WY
    representation within each chunk of `chunk` tokens, the recurrence across chunks. Shapes as kda_recurrent.
    The per-chunk decays [heads, C, C, dk] are made for KDA_GROUP_BYTES' worth of chunks at a time, not for the
    whole prompt at once (at GLM-5.3-Flash's 64 heads × 128: 128 MiB a chunk, 64 GiB for 32k tokens), and the
    chunk's triangular system (transformers' row-by-row substitution loop) is solved in one batched call."""
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))           # [Hh, T, d]
    beta = beta.transpose(0, 1)
    heads, t, dk = k.shape
    pad = (chunk - t % chunk) % chunk
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, v, g, k_beta, v_beta = (x.reshape(heads, -1, chunk, x.shape[-1]) for x in (q, k, v, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)
    mask = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=0)
    strict = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    out = torch.empty_like(v)
    n = v.shape[1]
    group = max(1, KDA_GROUP_BYTES // (heads * chunk * chunk * dk * q.element_size()))
    for c0 in range(0, n, group):
        grp = slice(c0, c0 + group)
        decay = (g[:, grp].unsqueeze(-2) - g[:, grp].unsqueeze(-3)).masked_fill(strict[..., None], float("-inf")).exp()
        attn = -(k_beta[:, grp].unsqueeze(-2) * k[:, grp].unsqueeze(-3) * decay).sum(dim=-1).masked_fill(mask, 0)
        # transformers' loop makes rows i of X = attn + attn·X (X strictly lower), so X + I = (I - attn)⁻¹
        attn = torch.linalg.solve_triangular(-attn, eye.expand_as(attn), upper=False, unitriangular=True)
        v_grp = attn @ v_beta[:, grp]
        k_cumdecay = attn @ (k_beta[:, grp] * g[:, grp].exp())
        for j in range(v_grp.shape[1]):
            i = c0 + j
            q_i, k_i, g_i = q[:, i], k[:, i], g[:, i]
            inter = (q_i * g_i.exp()) @ state
            intra = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay[:, j]).sum(dim=-1).masked_fill(strict, 0)
            v_new = v_grp[:, j] - k_cumdecay[:, j] @ state
            out[:, i] = inter + intra @ v_new
            state = (state * g_i[:, -1].exp().unsqueeze(-1)
                     + (k_i * (g_i[:, -1:] - g_i).exp()).transpose(-1, -2) @ v_new)
    out = out.reshape(heads, -1, out.shape[-1])[:, :t]
    return out.transpose(0, 1), state


class LinearAttention(nn.Module):
    """KDA (Glm5NextTextLinearAttention): q/k/v projections through a short causal depthwise conv + SiLU, the
    gated delta rule with a per-channel forget gate (bounded below by linear_lower_bound) and a sigmoid input gate,
    then an RMSNorm gated by a low-rank projection."""

    def __init__(self, model: "Glm5Next", w: WeightSource, layer: int):
        super().__init__()
        p, s = f"model.layers.{layer}.self_attn", model.spec
        self.caches, self.row, self.fused = model.caches, model.caches.row[layer], model.fused
        self.heads, self.hd, self.eps, self.lower = s.linear_heads, s.linear_head_dim, model.cfg.rms_eps, s.lower_bound
        self.qkv = Projection(torch.cat([w.get(f"{p}.{n}_proj.weight") for n in "qkv"]))
        self.conv = torch.cat([w.get(f"{p}.{n}_conv1d.weight", fp32=True) for n in "qkv"]).squeeze(1)   # [C, K]
        self.f_a, self.f_b = Projection(w.get(f"{p}.f_a_proj.weight")), Projection(w.get(f"{p}.f_b_proj.weight"))
        self.dt_bias, self.a_log = w.get(f"{p}.dt_bias", fp32=True), w.get(f"{p}.A_log", fp32=True)
        self.b = Projection(w.get(f"{p}.b_proj.weight"))
        self.g_a, self.g_b = Projection(w.get(f"{p}.g_a_proj.weight")), Projection(w.get(f"{p}.g_b_proj.weight"))
        self.o_norm = w.get(f"{p}.o_norm.weight", fp32=True)
        self.o = Projection(w.get(f"{p}.o_proj.weight"))

    def forget_gate(self, h: torch.Tensor) -> torch.Tensor:
        g = (self.f_b(self.f_a(h)).float() + self.dt_bias).view(h.shape[0], self.heads, self.hd)
        rate = self.a_log.exp().view(self.heads, 1)
        if self.lower is not None:
            return self.lower * torch.sigmoid(rate * g)
        return -rate * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))

    def forward(self, h: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        if self.fused and isinstance(segments, StaticDecode):      # conv, gates, delta rule, output norm: one launch
            out = triton_glm5.kda_decode(self.qkv(h), self.f_b(self.f_a(h)), self.b(h), self.g_b(self.g_a(h)),
                                         self.conv, self.caches.conv[self.row], self.caches.state[self.row],
                                         segments.idx, dt_bias=self.dt_bias, a_log=self.a_log, o_norm=self.o_norm,
                                         lower=self.lower, eps=self.eps)
            return self.o(out)
        mixed = self.qkv(h).float()                                   # [N, 3·qkv]; the conv runs in fp32
        g, beta = self.forget_gate(h), torch.sigmoid(self.b(h).float())
        if isinstance(segments, StaticDecode):
            core = self._decode(mixed, g, beta, segments.idx)
        elif all(s.length == 1 and s.start > 0 for s in segments):
            core = self._decode(mixed, g, beta, torch.tensor([s.slot for s in segments], device=mixed.device))
        else:
            core = self._segments(mixed, g, beta, segments)
        gate = self.g_b(self.g_a(h)).view(h.shape[0], self.heads, self.hd)
        out = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm
        out = (out * torch.sigmoid(gate.float())).to(h.dtype)
        return self.o(out.reshape(h.shape[0], -1))

    def _qk(self, y: torch.Tensor, n: int):
        q, k, v = (t.reshape(n, self.heads, self.hd) for t in y.split(y.shape[1] // 3, dim=1))
        return _l2norm(q) * self.hd ** -0.5, _l2norm(k), v

    def _decode(self, mixed, g, beta, idx: torch.Tensor) -> torch.Tensor:
        """One token for each sequence, all at once: their conv windows and states gathered by slot (idx [B])."""
        x = torch.cat([self.caches.conv[self.row, idx], mixed.unsqueeze(-1)], dim=-1)    # [B, C, kernel]
        self.caches.conv[self.row, idx] = x[..., 1:]
        q, k, v = self._qk(F.silu((x * self.conv).sum(-1)), idx.shape[0])
        core, state = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], self.caches.state[self.row, idx])
        self.caches.state[self.row, idx] = state
        return core[0]

    def _segments(self, mixed, g, beta, segments: list[Segment]) -> torch.Tensor:
        kernel = self.conv.shape[1]
        core = torch.empty(mixed.shape[0], self.heads, self.hd, dtype=torch.float32, device=mixed.device)
        for s in segments:
            rows = slice(s.row, s.row + s.length)
            conv_state = self.caches.conv[self.row, s.slot]          # the previous kernel-1 inputs (zeros at start)
            state = self.caches.state[self.row, s.slot]
            if s.start == 0:          # a sequence's first tokens: no past, whatever the slot held (a prefill's contract)
                conv_state.zero_()
                state.zero_()
            x = torch.cat([conv_state, mixed[rows].t()], dim=1)
            conv_state.copy_(x[:, -(kernel - 1):])
            y = F.silu(F.conv1d(x[None], self.conv[:, None], groups=x.shape[0])[0]).t()
            q, k, v = self._qk(y, s.length)
            run = kda_recurrent if s.length == 1 else kda_chunked
            core[rows], new = run(q, k, v, g[rows], beta[rows], state)
            state.copy_(new)
        return core


class Indexer:
    """The DSA indexer with k-pool compression (Glm5NextTextIndexer): each query scores the complete pools of
    index_kpool consecutive tokens it can see (a pool's key: the per-channel softmax-weighted mean of its tokens'
    keys), keeps the index_topk / index_kpool best, ties to the lower pool (the module docstring says why), and
    always adds its own incomplete pool (the tail)."""

    def __init__(self, model: "Glm5Next", w: WeightSource, prefix: str, layer: int):
        s = model.spec
        self.caches, self.row, self.fused = model.caches, model.caches.row["idx", layer], model.fused
        self.heads, self.hd, self.kpool = s.index_heads, s.index_head_dim, s.index_kpool
        self.pools = s.index_topk // s.index_kpool
        self.wq_b, self.wk = Projection(w.get(f"{prefix}.wq_b.weight")), Projection(w.get(f"{prefix}.wk.weight"))
        self.k_norm = (w.get(f"{prefix}.k_norm.weight"), w.get(f"{prefix}.k_norm.bias"))
        self.weights = Projection(w.get(f"{prefix}.weights_proj.weight"))
        self.ape = w.get(f"{prefix}.index_kpool_compress_ape", fp32=True)
        self.gate = Projection(w.get(f"{prefix}.index_kpool_compress_gate"))

    def write(self, h: torch.Tensor, segments: list[Segment]) -> None:
        k = F.layer_norm(self.wk(h), (self.hd,), *self.k_norm, eps=1e-6)
        packed = torch.cat([k, self.gate(h)], dim=-1)
        for s in segments:
            self.caches.index[self.row, s.slot, s.start:s.end] = packed[s.row:s.row + s.length]

    def write_static(self, h: torch.Tensor, st: StaticDecode) -> None:
        k = F.layer_norm(self.wk(h), (self.hd,), *self.k_norm, eps=1e-6)
        self.caches.index[self.row, st.idx, st.pos] = torch.cat([k, self.gate(h)], dim=-1)

    def select_static(self, h: torch.Tensor, q_resid: torch.Tensor, st: StaticDecode):
        """select's choice for a StaticDecode, as a fixed-size set: → (keys [B, S] positions, valid [B, S]),
        S = min(index_topk, the bucket's pools · index_kpool) + index_kpool. The pools of the first kv_len keys are
        scored (those past a sequence's position masked to -inf, as select masks the invisible ones), the
        index_topk / index_kpool best taken by the same stable sort (ties to the lower pool), and the tail added:
        the same keys select marks, whatever the bucket."""
        kp, b = self.kpool, h.shape[0]
        pos, dev = st.pos, h.device
        span = torch.arange(kp, device=dev)
        tail = ((pos + 1) // kp * kp)[:, None] + span                               # the incomplete pool
        tail_ok = tail <= pos[:, None]
        n_pools = st.kv_len // kp
        take = min(self.pools, n_pools)
        if not take:
            return tail, tail_ok
        q = self.wq_b(q_resid).view(b, self.heads, self.hd)
        pool_end = torch.arange(n_pools, device=dev) * kp + kp - 1
        visible = pool_end[None, :] <= pos[:, None]
        if self.fused:                  # pooling, scoring and the mask in one launch; the same sort below
            score = triton_glm5.indexer_scores(q, self.weights(h), self.caches.index[self.row], self.ape, st.idx, pos,
                                               n_pools, kp)
        else:
            packed = self.caches.index[self.row, st.idx, :n_pools * kp].view(b, n_pools, kp, 2 * self.hd)
            k, gate = packed.split(self.hd, dim=-1)
            prob = (gate.float() + self.ape).softmax(dim=2).to(k.dtype)
            pool_keys = (prob * k).sum(dim=2)                                       # [B, P, hd]
            scores = F.relu(torch.matmul(q.float(), pool_keys.transpose(1, 2).float()) * self.hd ** -0.5)
            w = self.weights(h).float() * self.heads ** -0.5
            score = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)               # [B, P]
            score = score.masked_fill(~visible, float("-inf"))
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :take]
        chosen = (order[:, :, None] * kp + span).reshape(b, take * kp)
        ok = visible.gather(1, order)[:, :, None].expand(b, take, kp).reshape(b, take * kp)   # no host read
        return torch.cat([chosen, tail], dim=1), torch.cat([ok, tail_ok], dim=1)

    def select(self, h: torch.Tensor, q_resid: torch.Tensor, s: Segment) -> torch.Tensor:
        """The keys each of the segment's queries attends: bool [T, end]."""
        rows = slice(s.row, s.row + s.length)
        kp, n_pools = self.kpool, s.end // self.kpool
        positions = torch.arange(s.start, s.end, device=h.device)
        keys = torch.arange(s.end, device=h.device)
        mask = keys[None, :] >= (positions + 1)[:, None] // kp * kp     # the tail: the query's incomplete pool
        mask &= keys[None, :] <= positions[:, None]
        take = min(self.pools, n_pools)
        if take:
            packed = self.caches.index[self.row, s.slot, :n_pools * kp].view(n_pools, kp, 2 * self.hd)
            k, gate = packed.split(self.hd, dim=-1)
            prob = (gate.float() + self.ape).softmax(dim=1).to(k.dtype)
            pool_keys = (prob * k).sum(dim=1)                                       # [P, hd]
            q = self.wq_b(q_resid[rows]).view(s.length, self.heads, self.hd)
            scores = F.relu(torch.matmul(q.float(), pool_keys.t().float()) * self.hd ** -0.5)   # [T, heads, P]
            w = self.weights(h[rows]).float() * self.heads ** -0.5
            score = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)               # [T, P]
            pool_end = torch.arange(n_pools, device=h.device) * kp + kp - 1
            visible = pool_end[None, :] <= positions[:, None]
            score = score.masked_fill(~visible, float("-inf"))
            order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :take]
            chosen = torch.zeros_like(visible).scatter_(1, order, True) & visible  # [T, P]
            mask[:, :n_pools * kp] |= chosen.repeat_interleave(kp, dim=1)
        return mask


class SparseAttention(nn.Module):
    """DSA (Glm5NextTextAttention): MLA with q and kv LoRA over NoPE heads; the latent is cached, each step expands
    the keys and values it reads. A `full` layer selects its keys with its own indexer, a `shared` one reuses the
    selection of the full layer before it."""

    def __init__(self, model: "Glm5Next", w: WeightSource, layer: int):
        super().__init__()
        p, s, c = f"model.layers.{layer}.self_attn", model.spec, model.cfg
        self.caches, self.row, self.eps, self.fused = model.caches, model.caches.row[layer], c.rms_eps, model.fused
        self.heads, self.nope, self.vd, self.rank = c.num_heads, s.qk_nope_head_dim, s.v_head_dim, s.kv_lora_rank
        self.q_a, self.q_norm = Projection(w.get(f"{p}.q_a_proj.weight")), w.get(f"{p}.q_a_layernorm.weight")
        self.q_b = Projection(w.get(f"{p}.q_b_proj.weight"))
        self.kv_a, self.kv_norm = Projection(w.get(f"{p}.kv_a_proj_with_mqa.weight")), w.get(f"{p}.kv_a_layernorm.weight")
        self.kv_b = Projection(w.get(f"{p}.kv_b_proj.weight"))
        self.o = Projection(w.get(f"{p}.o_proj.weight"))
        self.scale = self.nope ** -0.5
        self.indexer = Indexer(model, w, f"{p}.indexer", layer) if s.indexer_types[layer] == "full" else None

    def forward(self, h: torch.Tensor, segments: list[Segment], shared: list | None):
        """→ (output [N, H], the key selection of each of query_blocks(segments), for a shared layer after this one)."""
        q_resid = rms_norm(self.q_a(h), self.q_norm, self.eps)
        q = self.q_b(q_resid).view(h.shape[0], self.heads, self.nope)
        latent = rms_norm(self.kv_a(h), self.kv_norm, self.eps)
        if isinstance(segments, StaticDecode):
            return self._static(h, q, q_resid, latent, segments, shared)
        if self.indexer is not None:
            self.indexer.write(h, segments)
        for s in segments:
            self.caches.latent[self.row, s.slot, s.start:s.end] = latent[s.row:s.row + s.length]
        out, masks = torch.empty(h.shape[0], self.heads * self.vd, dtype=h.dtype, device=h.device), []
        # Queries in blocks (a shared layer reads the blocks' masks in the same order): a prefill's masks and indexer
        # scores are [queries, keys], O(T²) for a whole long prompt at once.
        for i, s in enumerate(query_blocks(segments)):
            rows = slice(s.row, s.row + s.length)
            cache = self.caches.latent[self.row, s.slot]
            mask = self.indexer.select(h, q_resid, s) if self.indexer is not None else shared[i]
            masks.append(mask)
            # Expand only the keys some query of the segment attends (a decode step: index_topk + the tail, not
            # the whole context); the others would weigh exactly zero.
            used = mask.any(0).nonzero().squeeze(1)
            kv = self.kv_b(cache[used]).view(used.shape[0], self.heads, self.nope + self.vd)
            k, v = kv.split([self.nope, self.vd], dim=-1)
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=mask[:, used], scale=self.scale)
            out[rows] = o.transpose(0, 1).reshape(s.length, -1)
        return self.o(out), masks

    def _static(self, h, q, q_resid, latent, st: StaticDecode, shared):
        """forward for a StaticDecode: the latent written at each sequence's position, its selected keys
        gathered in ascending order (the masked padding after them), expanded and attended → (output, the
        selection for a shared layer after this one)."""
        b = h.shape[0]
        self.caches.latent[self.row, st.idx, st.pos] = latent
        if self.indexer is not None:
            self.indexer.write_static(h, st)
            shared = self.indexer.select_static(h, q_resid, st)
        keys, valid = shared
        if self.fused:                  # absorbed projections over the selected latent rows, in any order
            kv_b = self.kv_b.weight.t() if self.kv_b.cpu else self.kv_b.weight              # [out, in]
            o = triton_glm5.mla_decode(q, kv_b, self.caches.latent[self.row], st.idx, keys, valid, nope=self.nope,
                                       scale=self.scale)
            return self.o(o), shared
        # Ascending keys, as forward reads them (`used`); the padding (not valid) sorts last and reads key 0.
        big = torch.iinfo(keys.dtype).max
        keys = torch.sort(torch.where(valid, keys, big), dim=1).values
        valid = keys != big
        cache = self.caches.latent[self.row, st.idx[:, None], torch.where(valid, keys, 0)]     # [B, S, rank]
        kv = self.kv_b(cache).view(b, keys.shape[1], self.heads, self.nope + self.vd)
        k, v = kv.split([self.nope, self.vd], dim=-1)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=valid[:, None, None, :], scale=self.scale)   # [B, heads, 1, vd]
        return self.o(o.reshape(b, -1)), shared


class Layer(nn.Module):
    def __init__(self, model: "Glm5Next", w: WeightSource, layer: int):
        super().__init__()
        p, s, c = f"model.layers.{layer}", model.spec, model.cfg
        self.kind, self.eps, self.fused = s.layer_types[layer], c.rms_eps, model.fused
        self.attn_hc, self.ffn_hc = (HyperConnection(w, f"{p}.hc_{n}", s, c.rms_eps) for n in ("attn", "ffn"))
        self.input_norm = w.get(f"{p}.input_layernorm.weight")
        self.post_norm = w.get(f"{p}.post_attention_layernorm.weight")
        self.attn = LinearAttention(model, w, layer) if self.kind == KDA else SparseAttention(model, w, layer)
        self.mlp = (Glm5MoeBlock(model, w, layer) if layer in set(c.moe_layers)
                    else ClampedMLP(w, f"{p}.mlp", s.swiglu_limit))

    def forward(self, streams: torch.Tensor, segments: list[Segment], shared: list | None):
        fused = self.fused and isinstance(segments, StaticDecode)
        merge = triton_glm5.hc_merge if fused else HyperConnection.merge
        post, comb, h = self.attn_hc(streams, fused)
        h = rms_norm(h, self.input_norm, self.eps)
        masks = shared                  # a KDA layer passes the last full layer's selection on
        if self.kind == KDA:
            out = self.attn(h, segments)
        else:
            out, masks = self.attn(h, segments, shared)
        streams = merge(post, comb, out, streams)
        post, comb, h = self.ffn_hc(streams, fused)
        out = self.mlp(rms_norm(h, self.post_norm, self.eps))
        return merge(post, comb, out, streams), masks


class ShapeChecked:
    """The model's weights, each checked against the shape the config gives it (a mis-shaped tensor is named
    here, in one line, not found by a failing matmul at the first request)."""

    def __init__(self, w: WeightSource, shapes: dict):
        self.w, self.shapes = w, shapes
        self.device, self.dtype = w.device, w.dtype

    def _check(self, name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        want = self.shapes[name][0]
        if t is not None and tuple(t.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {list(t.shape)}; the config makes it {list(want)}")
        return t

    def get(self, name: str, *, fp32: bool = False) -> torch.Tensor:
        return self._check(name, self.w.get(name, fp32=fp32))

    def maybe(self, name: str) -> torch.Tensor | None:
        return self._check(name, self.w.maybe(name))


class Glm5Next(nn.Module):
    bench_routing = None       # engine.routing_trace.BenchRouting where the loader installed one (benchmarking only)
    """The model: prefill (one sequence, many tokens, from any start) and decode_step (one token for each of
    many sequences), the interface engine.llm drives every architecture through."""

    def __init__(self, cfg: ModelConfig, w: WeightSource, provider: ExpertProvider, caches: Glm5Caches, *,
                 device, dtype: torch.dtype, fused_kernels: bool = True, int8_activations: bool = False, **_kernels):
        super().__init__()
        # **_kernels: the native kernel switch other models take; glm5_next's CPU forms are torch's
        if int8_activations:
            raise ValueError("cpu_activations int8: glm5_next has no int8-activation path (its CPU forms are torch's)")
        self.cfg, self.spec, self.provider, self.caches = cfg, caches.spec, provider, caches
        provider.use_swiglu_limit(caches.spec.swiglu_limit)      # the routed experts' clamp, in every kernel
        self.device, self.dtype = torch.device(device), dtype
        s = caches.spec
        # decode_static on engine.kernels.triton_glm5's fused kernels where Triton runs (CUDA) and the shapes fit;
        # off (EngineConfig.fused_kernels) for the torch forms, the A/B baseline. Read by the blocks built below.
        self.fused = (fused_kernels and triton_decode.serves_on(self.device)
                      and triton_glm5.shapes_ok(hc=s.hc_mult, linear_head_dim=s.linear_head_dim,
                                                kv_lora_rank=s.kv_lora_rank, index_head_dim=s.index_head_dim))
        w = ShapeChecked(w, tensor_shapes(caches.spec, layers=cfg.num_layers, hidden=cfg.hidden, vocab=cfg.vocab_size,
                                          heads=cfg.num_heads, intermediate=cfg.intermediate, moe_layers=cfg.moe_layers,
                                          experts=cfg.n_experts,
                                          shared_intermediate=cfg.moe_intermediate * cfg.n_shared_experts))
        self.embed = w.get("model.embed_tokens.weight")
        self.norm = w.get("model.norm.weight")
        head = w.maybe("lm_head.weight")
        self.head = Projection(head if head is not None else self.embed)
        self.layers = nn.ModuleList(Layer(self, w, l) for l in range(cfg.num_layers))
        self.graphs = None              # Glm5DecodeGraphs once use_cuda_graphs() is on (engine.llm reads it)
        if self.fused and DSA in s.layer_types:      # at load, not in the first long stream: each bucket's MLA variant
            t0, kp = time.perf_counter(), s.index_kpool
            # select_static's selection size at each bucket: its best pools (at most index_topk's) and the tail
            sizes = [min(s.index_topk // kp, n // kp) * kp + kp for n in kv_buckets(self.max_len)]
            attn = next(layer.attn for layer in self.layers if layer.kind == DSA)
            kv_b = attn.kv_b.weight.t() if attn.kv_b.cpu else attn.kv_b.weight
            n = triton_glm5.warm_mla(kv_b, caches.latent[0], sizes, heads=attn.heads, nope=attn.nope, scale=attn.scale)
            log.info("glm5 MLA decode: %d variants for %d KV buckets ready in %.1f s", n, len(sizes),
                     time.perf_counter() - t0)

    @staticmethod
    def caches_for(config: dict, cfg: ModelConfig, slots: int, max_len: int, *, dtype, device,
                   where: str = "config") -> Glm5Caches:
        """The caches this model declares (engine.loader allocates them before reading any weight)."""
        try:
            spec = Glm5Spec.from_config(config)
        except SpecError as e:
            raise CheckpointError(f"{where}: {e}") from None
        return Glm5Caches(spec, slots, max_len, dtype=dtype, device=device)

    @property
    def max_len(self) -> int:
        return self.caches.max_len

    def use_cuda_graphs(self) -> bool:
        """Replay decode steps from CUDA graphs (Glm5DecodeGraphs: the static-shape step, decode_static) where
        the device and the expert provider allow it, as MoEModel does. → whether decode_step now does."""
        if self.device.type != "cuda" or not self.provider.graph_capturable:
            return False
        self.graphs = Glm5DecodeGraphs(self)
        return True

    @property
    def async_decode(self) -> bool:
        """decode_step returns before the device has computed the step: graph replays (the eager step reads
        lengths on the host) of a provider with no host step inside them."""
        return self.graphs is not None and not self.provider.host_steps

    @property
    def decode_ahead_ok(self) -> bool:
        """A step may launch from the last one's tokens on the device (engine.decode_ahead), as MoEModel's."""
        return self.async_decode and not self.provider.decode_hooks

    def _run(self, ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        x = F.embedding(ids, self.embed)
        streams = x.unsqueeze(1).expand(-1, self.spec.hc_mult, -1).contiguous()
        masks = None
        for layer in self.layers:
            streams, masks = layer(streams, segments, masks)
        return rms_norm(streams.mean(dim=1), self.norm, self.cfg.rms_eps)

    def prefill(self, ids, slot: int, start: int = 0, all_logits: bool = False) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(-1)
        t = ids.shape[0]
        assert t > 0 and start + t <= self.max_len, f"{start}+{t} tokens exceed the cache's {self.max_len}"
        # Run in pieces that end where the prefix cache wants the KDA states kept (Glm5Caches.keep_at; at most the
        # prompt's last block and a branch point): the live states are then the snapshot, as a later chunk starts.
        points = self.caches.snapshot_points(slot, start, start + t)
        hs, at = [], start
        for end in sorted(set(points) | {start + t}):
            h = self._run(ids[at - start:end - start], [Segment(slot, at, 0, end - at)])
            hs.append(h if all_logits else h[-1:])
            if end in points:
                self.caches.snapshot(slot, end)
            at = end
        h = torch.cat(hs) if len(hs) > 1 else hs[0]
        return self.head(h if all_logits else h[-1])

    def decode_step(self, tokens, slots: list[int], positions: list[int]) -> torch.Tensor:
        """One token per sequence → logits [B, V]; replayed from a CUDA graph where use_cuda_graphs() is on and the
        batch fits, else eager. The provider's hooks run around the launch, as MoEModel.decode_step's."""
        b = len(slots)
        assert b == len(positions) and max(positions) < self.max_len, "decode position beyond the cache"
        self.provider.before_decode()
        if self.graphs is not None and self.graphs.usable(b):
            logits = self.graphs.decode(tokens, slots, positions)
        else:
            ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(-1)
            if self.fused:          # an eager CUDA step (no graphs, or a batch past them) on the fused kernels too
                logits = self.decode_static(ids, torch.tensor(slots, device=self.device),
                                            torch.tensor(positions, device=self.device),
                                            kv_bucket(max(positions) + 1, self.max_len))
            else:
                logits = self.head(self._run(ids, [Segment(s, p, i, 1) for i, (s, p) in enumerate(zip(slots, positions))]))
        self.caches.after_decode(slots, positions)       # the KDA states at block boundaries (prefix reuse)
        self.provider.after_decode_launch(b * self.cfg.top_k)
        return logits

    def decode_static(self, ids: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """decode_step's function at fixed shapes and without a host read (what a CUDA graph captures): tokens
        ids [B], slots idx [B] and positions pos [B] as device tensors, kv_len a key bucket past every position
        (engine.kv_cache.kv_bucket) → logits [B, V]. Equal to the eager step (tests/engine/test_glm5_next.py)."""
        return self.head(self._run(ids, StaticDecode(idx, pos, kv_len)))


class Glm5DecodeGraphs(DecodeGraphs):
    """engine.gpu.graphs.DecodeGraphs for glm5_next: the same staging, buckets, capture and replay, around the
    static-shape step (Glm5Next.decode_static). Capture runs the step once eagerly first (DecodeGraphs._capture);
    a KV write is simply redone at replay, but the KDA recurrent and conv states would advance twice, so they are
    put back for the captured slots after it."""

    def _forward(self, b: int, kv_len: int) -> torch.Tensor:
        m = self.model
        return m.decode_static(self.static[0, :b], self.static[2, :b], self.static[1, :b], kv_len)

    def _capture(self, b: int, kv_len: int):
        caches, idx = self.model.caches, self.static[2, :b]
        state, conv = caches.state[:, idx].clone(), caches.conv[:, idx].clone()
        out = super()._capture(b, kv_len)
        caches.state[:, idx] = state
        caches.conv[:, idx] = conv
        return out

"""Fused Triton kernels for a CUDA decode step's own layers (the experts' kernels are engine.kernels.triton_moe).

A decode step is one token per sequence, so every op is tiny and a step is bound by how many kernels it
launches, not by bytes: the torch form of one Qwen3-MoE layer is ~80 launches (norms, the rotary's cat/neg/
mul/add, index_put for the KV write, the mask and SDPA, softmax/topk/renormalise...), 24 layers ~1,900 per
token — about 4 ms of an H200's 4.2 ms step, against 0.8 ms of HBM traffic. Fused here, one launch each:

  add_rms_norm      x ← x + r;  h ← rms_norm(x)·w            (the residual add and the next norm)
  qk_rope_kv        q/k RMSNorm per head, rotary, k and v written into the KV cache at (slot, position)
  decode_attention  GQA attention of one query per sequence over its own cached keys (split over the keys
                    for long contexts, then combined): no mask tensor, no transposes
  softmax_topk      router softmax (fp32), top-k, renormalise, weights in the model dtype

Each reproduces the torch ops it replaces, including where they round to the model dtype (`_round`), so a
fused step agrees with the torch step to accumulation order (tests/engine/test_fused_decode.py runs them
through Triton's interpreter on CPU tensors against the torch forms). Only decode uses them (MoEModel picks
them per step: engine.models.common.fused_decode); prefill keeps torch's flash attention and GEMMs. Plain
Triton (no Hopper-only features): the same source runs on sm_86 and sm_90.
"""
from __future__ import annotations

import torch

from engine.kernels import import_triton

# Triton ships with CUDA builds of torch; CPU-only installs use the torch forms (and do not import triton at all).
triton, tl = import_triton()

ATTN_BLOCK = 64         # keys per attention load
ATTN_KEYS = 128         # keys per attention program, until ATTN_MAX_SPLITS programs share a sequence's head
ATTN_MAX_SPLITS = 64


def serves_on(device: torch.device) -> bool:
    """A model on `device` decodes with these kernels: CUDA with Triton. (Tests patch this to run a CPU model
    through the interpreter: tests/engine/test_fused_decode.py.)"""
    return triton is not None and device.type == "cuda"


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def attention_ok(head_dim: int, rotary_dim: int, hidden: int) -> bool:
    """The kernels load a head or a row in one block: a power-of-two head, an even rotary, a bounded row."""
    return _pow2(head_dim) and rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim and hidden <= 16384


def topk_ok(n_experts: int, top_k: int) -> bool:
    """softmax_topk holds the router's logits in one block and its picks in a power-of-two vector."""
    return n_experts <= 1024 and _pow2(top_k) and top_k <= n_experts


if triton is not None:
    @triton.jit
    def _round(x, ty: tl.constexpr):
        """x rounded to the model dtype and back: where the torch op being replaced writes its result."""
        return x.to(ty).to(tl.float32)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        ty = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        s = _round(x + r, ty)                                   # torch: x + r in the model dtype
        tl.store(x_ptr + row * N + cols, s.to(ty), mask=m)
        inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / N + eps)    # F.rms_norm: fp32 statistics
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * N + cols, (s * inv * w).to(ty), mask=m)

    @triton.jit
    def _qk_rope_kv_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                           QKV_STRIDE, COS_STRIDE, KS_SLOT, KS_POS, KS_HEAD, eps,
                           NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
                           NORM: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        ty = q_ptr.dtype.element_ty
        d = tl.arange(0, HD)
        src = qkv_ptr + b * QKV_STRIDE + head * HD
        pos = tl.load(pos_ptr + b).to(tl.int64)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if head >= NH + NKV:                                     # a value head: into the cache as it is
            vh = head - NH - NKV
            tl.store(v_ptr + slot * KS_SLOT + pos * KS_POS + vh * KS_HEAD + d, tl.load(src + d))
        else:
            half: tl.constexpr = ROT // 2
            partner = tl.where(d < half, d + half, d - half)
            partner = tl.where(d < ROT, partner, d)
            x = tl.load(src + d).to(tl.float32)
            xp = tl.load(src + partner).to(tl.float32)
            if NORM:                                             # q_norm / k_norm per head (Qwen3, GLM qk-norm)
                is_q = head < NH
                inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + eps)
                wq = tl.load(qn_ptr + d).to(tl.float32)
                wk = tl.load(kn_ptr + d).to(tl.float32)
                wqp = tl.load(qn_ptr + partner).to(tl.float32)
                wkp = tl.load(kn_ptr + partner).to(tl.float32)
                x = _round(x * inv * tl.where(is_q, wq, wk), ty)
                xp = _round(xp * inv * tl.where(is_q, wqp, wkp), ty)
            rot = d < ROT
            c = tl.load(cos_ptr + pos * COS_STRIDE + d, mask=rot, other=1.0).to(tl.float32)
            s = tl.load(sin_ptr + pos * COS_STRIDE + d, mask=rot, other=0.0).to(tl.float32)
            # apply_rotary: x·cos + rotate_half(x)·sin, each product and the sum rounded as torch rounds them
            signed = tl.where(d < half, -xp, xp)
            y = _round(_round(x * c, ty) + _round(signed * s, ty), ty)
            y = tl.where(rot, y, x)
            if head < NH:
                tl.store(q_ptr + (b * NH + head) * HD + d, y.to(ty))
            else:
                kh = head - NH
                tl.store(k_ptr + slot * KS_SLOT + pos * KS_POS + kh * KS_HEAD + d, y.to(ty))

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, o_ptr, part_ptr, ml_ptr,
                                 KS_SLOT, KS_POS, KS_HEAD, scale, WINDOW,
                                 NH: tl.constexpr, GROUPS: tl.constexpr, HD: tl.constexpr, CHUNK: tl.constexpr,
                                 SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        ty = o_ptr.dtype.element_ty
        slot = tl.load(slot_ptr + b).to(tl.int64)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        kvh = h // GROUPS
        first = (sp * CHUNK).to(tl.int64)
        hi = tl.minimum(first + CHUNK, pos + 1)
        lo = first
        if WINDOW > 0:                                           # sliding window: keys after pos - WINDOW
            lo = tl.maximum(first, pos - WINDOW + 1)
        d = tl.arange(0, HD)
        q = tl.load(q_ptr + (b * NH + h) * HD + d).to(tl.float32)
        base_k = k_ptr + slot * KS_SLOT + kvh * KS_HEAD
        base_v = v_ptr + slot * KS_SLOT + kvh * KS_HEAD
        l_i = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)
        m_i = l_i - 1.0e30                                       # finite: an empty split stays NaN-free
        acc = tl.zeros([HD], dtype=tl.float32)
        # A fixed trip count (the chunk's blocks) with the blocks past the keys skipped: the bounds are
        # per sequence, read on the device, and Triton's interpreter (CI) takes no tensor-valued range.
        for it in range(CHUNK // BLOCK_N):
            start = first + it * BLOCK_N
            if start < hi:
                n = start + tl.arange(0, BLOCK_N)
                nm = (n < hi) & (n >= lo)
                kt = tl.load(base_k + n[:, None] * KS_POS + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
                sc = tl.sum(kt * q[None, :], axis=1) * scale
                sc = tl.where(nm, sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=0))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(sc - m_new)
                vt = tl.load(base_v + n[:, None] * KS_POS + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
                l_i = l_i * alpha + tl.sum(p, axis=0)
                acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
                m_i = m_new
        if SPLITS == 1:
            tl.store(o_ptr + (b * NH + h) * HD + d, (acc / l_i).to(ty))
        else:
            row = (b * NH + h) * SPLITS + sp
            tl.store(part_ptr + row * HD + d, acc)
            tl.store(ml_ptr + row * 2, m_i)
            tl.store(ml_ptr + row * 2 + 1, l_i)

    @triton.jit
    def _attention_combine_kernel(part_ptr, ml_ptr, o_ptr, HD: tl.constexpr, SPLITS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)                      # b * NH + h
        s = tl.arange(0, SPLITS)
        m = tl.load(ml_ptr + (row * SPLITS + s) * 2)
        l = tl.load(ml_ptr + (row * SPLITS + s) * 2 + 1)
        big = tl.max(m, axis=0)
        f = tl.exp(m - big)
        d = tl.arange(0, HD)
        parts = tl.load(part_ptr + (row * SPLITS + s)[:, None] * HD + d[None, :])
        o = tl.sum(parts * f[:, None], axis=0) / tl.sum(l * f, axis=0)
        tl.store(o_ptr + row * HD + d, o.to(o_ptr.dtype.element_ty))

    @triton.jit
    def _softmax_topk_kernel(logit_ptr, ids_ptr, w_ptr, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr,
                             RENORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        lg = tl.load(logit_ptr + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
        ex = tl.exp(lg - tl.max(lg, axis=0))
        p = ex / tl.sum(ex, axis=0)                              # softmax in fp32, as torch.softmax(dtype=fp32)
        p = tl.where(e < E, p, -1.0)
        kk = tl.arange(0, K)
        ids = tl.zeros([K], dtype=tl.int64)
        vals = tl.zeros([K], dtype=tl.float32)
        for k in tl.static_range(K):                             # top-k in descending order, as torch.topk
            best = tl.max(p, axis=0)
            j = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)  # ties: the lowest expert id
            ids = tl.where(kk == k, j.to(tl.int64), ids)
            vals = tl.where(kk == k, best, vals)
            p = tl.where(e == j, -1.0, p)
        if RENORM:
            vals = vals / tl.sum(vals, axis=0)
        tl.store(ids_ptr + t * K + kk, ids)
        tl.store(w_ptr + t * K + kk, vals.to(w_ptr.dtype.element_ty))


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += r (in place, rounded to x.dtype); returns rms_norm(x)·weight. x, r [..., N] contiguous."""
    n = x.shape[-1]
    h = torch.empty_like(x)
    rows = x.numel() // n
    _add_rms_norm_kernel[(rows,)](x, r.contiguous(), weight, h, eps, N=n, BLOCK=triton.next_power_of_2(n),
                                  num_warps=4 if n >= 1024 else 1)
    return h


def qk_rope_kv(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> torch.Tensor:
    """One token per sequence. qkv [B, (NH+2·NKV)·HD]; cos/sin [max_len, rotary_dim] tables; positions, slots [B];
    k_cache/v_cache one layer's [slots, max_len, NKV, HD]. Writes k (normed, rotated) and v at (slot, position);
    returns q [B, NH, HD] normed and rotated."""
    b = qkv.shape[0]
    q = torch.empty(b, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    _qk_rope_kv_kernel[(b, num_heads + 2 * num_kv_heads)](
        qkv, q_norm if norm else qkv, k_norm if norm else qkv, cos, sin, positions, slots, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        NH=num_heads, NKV=num_kv_heads, HD=head_dim, ROT=cos.shape[-1], NORM=norm, num_warps=1)
    return q


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, kv_len: int, *, scale: float, window: int = 0) -> torch.Tensor:
    """q [B, NH, HD]: each sequence's query attends over keys 0..position of its slot (within `window` if set).
    kv_len bounds the positions (the step's KV bucket: a fixed grid per CUDA graph). Returns [B, NH·HD]."""
    b, nh, hd = q.shape
    groups = nh // k_cache.shape[2]
    splits, chunk = attention_variant(kv_len)
    o = torch.empty(b, nh * hd, dtype=q.dtype, device=q.device)
    if splits == 1:
        part = ml = o
    else:
        part = torch.empty(b * nh * splits, hd, dtype=torch.float32, device=q.device)
        ml = torch.empty(b * nh * splits, 2, dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(b, nh, splits)](
        q, k_cache, v_cache, slots, positions, o, part, ml, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scale, window, NH=nh, GROUPS=groups, HD=hd, CHUNK=chunk, SPLITS=splits, BLOCK_N=ATTN_BLOCK, num_warps=4)
    if splits > 1:
        _attention_combine_kernel[(b * nh,)](part, ml, o, HD=hd, SPLITS=splits, num_warps=1)
    return o


def attention_variant(kv_len: int) -> tuple[int, int]:
    """decode_attention's (SPLITS, CHUNK) at this KV bucket: its compiled variant. The keys are split so that a
    one-sequence decode still fills the GPU (32 heads x 1 program measured 14.8 us at 256 keys on the H200), the
    split count a power of two (the combine kernel's vector) and bounded."""
    splits = min(ATTN_MAX_SPLITS, triton.next_power_of_2(triton.cdiv(kv_len, ATTN_KEYS)))
    return splits, triton.cdiv(triton.cdiv(kv_len, splits), ATTN_BLOCK) * ATTN_BLOCK


def warm_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens, *, num_heads: int, scale: float,
                   window: int = 0) -> int:
    """Compile decode_attention for every variant these KV buckets use, now: one launch each (one query of
    zeros over slot 0's keys, the output dropped; nothing is written to the cache). Otherwise the first stream
    to grow into a longer bucket stops mid-decode while Triton compiles (seen on the H200: ~14 % of a
    5,000-token stream's samples, bench/results/2026-12-01-h200-served-profile.json). → variants launched."""
    first: dict[tuple[int, int], int] = {}
    for n in kv_lens:
        first.setdefault(attention_variant(n), n)
    dev = k_cache.device
    q = torch.zeros(1, num_heads, k_cache.shape[-1], dtype=k_cache.dtype, device=dev)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    for n in first.values():
        decode_attention(q, k_cache, v_cache, zero, zero, n, scale=scale, window=window)
    return len(first)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype):
    """engine.models.common.softmax_topk in one launch: (ids [T, K] int64, weights [T, K] out_dtype)."""
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.long, device=logits.device)
    w = torch.empty(t, top_k, dtype=out_dtype, device=logits.device)
    _softmax_topk_kernel[(t,)](logits.contiguous(), ids, w, E=e, K=top_k, BLOCK_E=triton.next_power_of_2(e),
                               RENORM=renormalize, num_warps=1)
    return ids, w

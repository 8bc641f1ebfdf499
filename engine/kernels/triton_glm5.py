"""Fused Triton kernels for glm5_next's (GLM-5.3-Flash) CUDA decode step: what its architecture adds over the MoE
models engine.kernels.triton_decode serves. Each replaces a run of small torch ops of engine.models.glm5_next's
static step (decode_static, captured per batch and KV bucket as a CUDA graph), with the same function:

  hc_pre         mHC: the streams' RMS and the mixing GEMV (split over the row), then pre/post/comb with the
                 Sinkhorn iterations in registers and the collapsed block input (HyperConnection.__call__: 137
                 torch ops at 20 iterations, counted on the CPU, most of them the Sinkhorn's sums and divisions;
                 now 2 launches)
  hc_merge       mHC: post·out + combᵀ·streams (HyperConnection.merge: 4 ops), one launch
  kda_decode     KDA for one token per sequence: the short convolutions' window update, SiLU, l2-normed q/k,
                 the forget gate and beta, the gated delta rule on the recurrent state, and the gated RMSNorm
                 of the output (LinearAttention._decode and the forward around it), one program per (seq, head)
  mla_decode     MLA over the latent cache with absorbed projections: q_lat = q_nope·W_kb per head, softmax of
                 q_lat·latent over the DSA selection only, o = (p·latent)·W_vbᵀ: no expanded K/V (the torch step
                 expands every selected key through kv_b: 2,064 keys × 64 heads × 512 per layer and token)
  indexer_scores the DSA indexer's pooled scores (the k-pool compression, the ReLU'd per-head dot products, their
                 weighted sum, the invisible pools masked): the top-k stays torch's stable sort, so ties still go
                 to the lower pool (decode_static's order)

The mixing and the recurrences round where the torch forms round; the MLA is a reassociation of the expanded form
(equal within float tolerance, not bitwise). tests/engine/test_glm5_triton.py runs each through Triton's
interpreter on CPU tensors against the torch forms, and a whole fused decode_static against the torch step.
"""
from __future__ import annotations

import os

import torch

from engine.kernels import import_triton
from engine.kernels.triton_decode import attention_variant

triton, tl = import_triton()

HC_BLOCK_K = 256        # mHC GEMV: elements of the flattened streams per load
HC_SPLITS = 16          # mHC GEMV: programs sharing one token's row (4 × hidden 4096 / 16 = 1,024 elements each)
HC_BLOCK_H = 256        # mHC collapse and merge: hidden elements per program
HC_TOKENS = 16          # mHC mixing: tokens per program (the Sinkhorn's steps shared by them)
MLA_HEADS = 16          # MLA: heads per program (tl.dot's smallest M)
MLA_KEYS = 32           # MLA: latent rows per load (32 x 512 bf16: 32 KiB, two stages in shared memory)
INDEX_POOLS = 16        # indexer: pools per program (tl.dot's smallest N)


def shapes_ok(*, hc: int, linear_head_dim: int, kv_lora_rank: int, index_head_dim: int) -> bool:
    """The kernels hold the mHC matrices, a KDA head's state [d, d] (in registers: GLM-5.3-Flash's d = 128 is what
    was compiled and checked), an MLA latent row and an indexer key in one block each: bounded sizes."""
    return hc <= 16 and linear_head_dim <= 128 and kv_lora_rank <= 1024 and index_head_dim <= 256


if triton is not None:
    @triton.jit
    def _dot(a, b, F32: tl.constexpr):
        """a·b with fp32 sums. F32 (an fp32 model, or Triton's interpreter, whose dot of bf16 blocks returns
        garbage in 3.6): both in fp32, IEEE products — the same values as the tensor cores' bf16 products."""
        if F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    # ------------------------------------------------------------ mHC

    @triton.jit
    def _hc_dots_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, K, CHUNK: tl.constexpr, M: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLITS: tl.constexpr):
        """Token n's flattened streams x [K] against fn [M, K] over one split of K: partial dots and Σx²."""
        n = tl.program_id(0).to(tl.int64)
        sp = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        mm = m < M
        acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for it in range(CHUNK // BLOCK_K):
            k = sp * CHUNK + it * BLOCK_K + tl.arange(0, BLOCK_K)
            km = k < K
            x = tl.load(x_ptr + n * K + k, mask=km, other=0.0).to(tl.float32)
            w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            acc += w * x[None, :]
            sq += x * x
        row = n * SPLITS + sp
        tl.store(part_ptr + row * BLOCK_M + m, tl.sum(acc, axis=1))
        tl.store(sq_ptr + row, tl.sum(sq, axis=0))

    @triton.jit
    def _hc_mix_kernel(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, N, K, H,
                       eps, hc_eps, HC: tl.constexpr, BLOCK_HC: tl.constexpr, ITERS: tl.constexpr,
                       BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """For BLOCK_T tokens at once (the Sinkhorn's many small steps paid once for them all): the partial dots
        summed and scaled by each row's RMS, then pre / post / comb as HyperConnection.__call__, and the collapsed
        input Σ pre_i·streams_i for one block of hidden; the first block's programs also write post and comb."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < N
        t = t.to(tl.int64)
        hb = tl.program_id(1)
        s = tl.arange(0, SPLITS)
        i = tl.arange(0, BLOCK_HC)
        im = i < HC
        ij = tl.arange(0, BLOCK_HC * BLOCK_HC)                              # comb[i, j], flattened
        ijm = (ij // BLOCK_HC < HC) & (ij % BLOCK_HC < HC)
        cij = 2 * HC + (ij // BLOCK_HC) * HC + ij % BLOCK_HC                # comb[i, j] = mix[2hc + i·hc + j]
        rows = (t[:, None] * SPLITS + s[None, :]) * BLOCK_M                 # [T, S]
        sq = tl.load(sq_ptr + t[:, None] * SPLITS + s[None, :], mask=tm[:, None], other=0.0)
        inv = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)                   # [T]
        m_ti = tm[:, None, None] & im[None, None, :]
        pre_w = tl.sum(tl.load(part_ptr + rows[:, :, None] + i[None, None, :], mask=m_ti, other=0.0), axis=1)
        post_w = tl.sum(tl.load(part_ptr + rows[:, :, None] + HC + i[None, None, :], mask=m_ti, other=0.0), axis=1)
        comb_w = tl.sum(tl.load(part_ptr + rows[:, :, None] + cij[None, None, :],
                                mask=tm[:, None, None] & ijm[None, None, :], other=0.0), axis=1)   # [T, HC·HC]
        pre_s = tl.load(scale_ptr)
        post_s = tl.load(scale_ptr + 1)
        comb_s = tl.load(scale_ptr + 2)
        pre = tl.sigmoid(pre_w * inv[:, None] * pre_s + tl.load(base_ptr + i, mask=im, other=0.0)[None, :]) + hc_eps
        post = 2 * tl.sigmoid(post_w * inv[:, None] * post_s + tl.load(base_ptr + HC + i, mask=im, other=0.0)[None, :])
        c = comb_w * inv[:, None] * comb_s + tl.load(base_ptr + cij, mask=ijm, other=0.0)[None, :]
        c = tl.reshape(tl.where(ijm[None, :], c, float("-inf")), (BLOCK_T, BLOCK_HC, BLOCK_HC))
        cm = (im[:, None] & im[None, :])[None, :, :]
        c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
        c = tl.where(cm, c / tl.sum(c, axis=2)[:, :, None] + hc_eps, 0.0)   # softmax over j, + eps
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)                     # columns
        for _ in tl.static_range(ITERS - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)                 # rows
            c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)                 # columns
        if hb == 0:
            tl.store(post_ptr + t[:, None] * HC + i[None, :], post, mask=tm[:, None] & im[None, :])
            tl.store(comb_ptr + t[:, None, None] * HC * HC + i[None, :, None] * HC + i[None, None, :], c,
                     mask=tm[:, None, None] & cm)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        x = tl.load(x_ptr + t[:, None, None] * K + i[None, :, None] * H + h[None, None, :],
                    mask=tm[:, None, None] & im[None, :, None] & hm[None, None, :], other=0.0)
        out = tl.sum(pre[:, :, None] * x.to(tl.float32), axis=1)
        tl.store(out_ptr + t[:, None] * H + h[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=tm[:, None] & hm[None, :])

    @triton.jit
    def _hc_merge_kernel(x_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, H, HC: tl.constexpr, BLOCK_HC: tl.constexpr,
                         BLOCK_H: tl.constexpr):
        """new_i = post_i·out + Σ_j comb[j, i]·streams_j, rounded as HyperConnection.merge rounds: post and comb to
        the model dtype, the product and the matmul (fp32 sums) each once, then their sum."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        ty = new_ptr.dtype.element_ty
        i = tl.arange(0, BLOCK_HC)
        im = i < HC
        post = tl.load(post_ptr + n * HC + i, mask=im, other=0.0).to(ty).to(tl.float32)
        comb = tl.load(comb_ptr + n * HC * HC + i[:, None] * HC + i[None, :], mask=im[:, None] & im[None, :],
                       other=0.0).to(ty).to(tl.float32)                           # [j, i]
        o = tl.load(out_ptr + n * H + h, mask=hm, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + n * HC * H + i[:, None] * H + h[None, :], mask=im[:, None] & hm[None, :],
                    other=0.0).to(tl.float32)                                     # [j, h]
        mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0).to(ty).to(tl.float32)      # [i, h]
        expanded = (post[:, None] * o[None, :]).to(ty).to(tl.float32)
        tl.store(new_ptr + n * HC * H + i[:, None] * H + h[None, :], (expanded + mixed).to(ty),
                 mask=im[:, None] & hm[None, :])

    # ------------------------------------------------------------ KDA

    @triton.jit
    def _kda_decode_kernel(mixed_ptr, fb_ptr, b_ptr, gate_ptr, convw_ptr, conv_ptr, state_ptr, idx_ptr,
                           dt_bias_ptr, a_log_ptr, onorm_ptr, out_ptr,
                           CS_SLOT, CS_CH, SS_SLOT, lower, eps, qscale,
                           HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, KERNEL: tl.constexpr,
                           KP: tl.constexpr, HAS_LOWER: tl.constexpr):
        """Sequence b, head h: the conv windows of its q, k, v channels advanced by this token, q/k/v, g and beta,
        the delta rule on its state [dk, dv] and the output's gated RMSNorm, written in the model dtype."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        QKV: tl.constexpr = HEADS * D
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        slot = tl.load(idx_ptr + b).to(tl.int64)
        jj = tl.arange(0, KP)
        q = tl.zeros([BLOCK_D], dtype=tl.float32)
        k = tl.zeros([BLOCK_D], dtype=tl.float32)
        v = tl.zeros([BLOCK_D], dtype=tl.float32)
        for part in tl.static_range(3):
            c = part * QKV + h * D + d
            win = conv_ptr + slot * CS_SLOT + c * CS_CH
            new = tl.load(mixed_ptr + b * 3 * QKV + c, mask=dm, other=0.0).to(tl.float32)
            # The whole window, oldest first, read before any of it is written: threads holding copies of one
            # channel (a block wider than the channels) would otherwise read a place another has already shifted.
            wm = dm[:, None] & (jj[None, :] < KERNEL - 1)
            x = tl.load(win[:, None] + jj[None, :], mask=wm, other=0.0)                        # [BLOCK_D, KP]
            acc = tl.sum(x * tl.load(convw_ptr + c[:, None] * KERNEL + jj[None, :], mask=wm, other=0.0), axis=1)
            acc += new * tl.load(convw_ptr + c * KERNEL + KERNEL - 1, mask=dm, other=0.0)
            tl.debug_barrier()
            tl.store(win[:, None] + jj[None, :] - 1, x, mask=wm & (jj[None, :] > 0))          # shifted one back
            tl.store(win + KERNEL - 2, new, mask=dm)
            y = acc * tl.sigmoid(acc)                        # SiLU
            if part == 0:
                q = y
            elif part == 1:
                k = y
            else:
                v = y
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * qscale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        graw = tl.load(fb_ptr + b * QKV + h * D + d, mask=dm, other=0.0).to(tl.float32)
        graw = graw + tl.load(dt_bias_ptr + h * D + d, mask=dm, other=0.0)
        rate = tl.exp(tl.load(a_log_ptr + h))
        if HAS_LOWER:
            g = lower * tl.sigmoid(rate * graw)
        else:
            g = -rate * tl.where(graw > 20.0, graw, tl.log(1.0 + tl.exp(graw)))
        beta = tl.sigmoid(tl.load(b_ptr + b * HEADS + h).to(tl.float32))
        sp = state_ptr + slot * SS_SLOT + h * D * D + d[:, None] * D + d[None, :]
        sm = dm[:, None] & dm[None, :]
        st = tl.load(sp, mask=sm, other=0.0) * tl.exp(g)[:, None]           # [dk, dv]
        kv_mem = tl.sum(st * k[:, None], axis=0)
        delta = (v - kv_mem) * beta
        st = st + k[:, None] * delta[None, :]
        tl.debug_barrier()              # every copy of the state read before any is written back (as above)
        tl.store(sp, st, mask=sm)
        o = tl.sum(st * q[:, None], axis=0)
        o = o / tl.sqrt(tl.sum(o * o, axis=0) / D + eps) * tl.load(onorm_ptr + d, mask=dm, other=0.0)
        gate = tl.load(gate_ptr + b * QKV + h * D + d, mask=dm, other=0.0).to(tl.float32)
        o = o * tl.sigmoid(gate)
        tl.store(out_ptr + b * QKV + h * D + d, o.to(out_ptr.dtype.element_ty), mask=dm)

    # ------------------------------------------------------------ MLA

    @triton.jit
    def _mla_attention_kernel(qlat_ptr, lat_ptr, idx_ptr, keys_ptr, valid_ptr, o_ptr, part_ptr, ml_ptr,
                              QS_H, QS_B, LS_SLOT, LS_POS, OS_H, OS_B, S, scale, B,
                              H: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BH: tl.constexpr,
                              CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                              F32: tl.constexpr):
        """Sequence b, heads [hb·BH, +BH), the selected keys of one split: scores q_lat·latent over the gathered
        latent rows (the invalid padding masked), an online softmax, p·latent accumulated."""
        b = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        sp = tl.program_id(2)
        heads = hb * BH + tl.arange(0, BH)
        hm = heads < H
        r = tl.arange(0, BLOCK_R)
        rm = r < R
        slot = tl.load(idx_ptr + b).to(tl.int64)
        q = tl.load(qlat_ptr + heads[:, None] * QS_H + b * QS_B + r[None, :], mask=hm[:, None] & rm[None, :],
                    other=0.0)
        m_i = tl.zeros([BH], dtype=tl.float32) - 1.0e30          # finite: an empty split stays NaN-free
        l_i = tl.zeros([BH], dtype=tl.float32)
        acc = tl.zeros([BH, BLOCK_R], dtype=tl.float32)
        for it in range(CHUNK // BLOCK_N):
            n = sp * CHUNK + it * BLOCK_N + tl.arange(0, BLOCK_N)
            nm = n < S
            key = tl.load(keys_ptr + b * S + n, mask=nm, other=0).to(tl.int64)
            ok = (tl.load(valid_ptr + b * S + n, mask=nm, other=0) != 0) & nm
            lat = tl.load(lat_ptr + slot * LS_SLOT + key[:, None] * LS_POS + r[None, :],
                          mask=ok[:, None] & rm[None, :], other=0.0)             # [BLOCK_N, R]
            sc = _dot(q, tl.trans(lat), F32)
            sc = tl.where(ok[None, :], sc * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = _dot(p.to(lat.dtype), lat, F32)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        om = hm[:, None] & rm[None, :]
        if SPLITS == 1:
            tl.store(o_ptr + heads[:, None] * OS_H + b * OS_B + r[None, :],
                     (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=om)
        else:
            row = (heads * B + b) * SPLITS + sp                                   # [BH]
            tl.store(part_ptr + row[:, None] * BLOCK_R + r[None, :], acc, mask=om)
            tl.store(ml_ptr + row * 2, m_i, mask=hm)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=hm)

    @triton.jit
    def _mla_combine_kernel(part_ptr, ml_ptr, o_ptr, R: tl.constexpr, BLOCK_R: tl.constexpr,
                            SPLITS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)                      # h · B + b: o_lat's [H, B, R] layout
        s = tl.arange(0, SPLITS)
        m = tl.load(ml_ptr + (row * SPLITS + s) * 2)
        l = tl.load(ml_ptr + (row * SPLITS + s) * 2 + 1)
        f = tl.exp(m - tl.max(m, axis=0))
        r = tl.arange(0, BLOCK_R)
        parts = tl.load(part_ptr + (row * SPLITS + s)[:, None] * BLOCK_R + r[None, :])
        o = tl.sum(parts * f[:, None], axis=0) / tl.sum(l * f, axis=0)
        tl.store(o_ptr + row * R + r, o.to(o_ptr.dtype.element_ty), mask=r < R)

    # ------------------------------------------------------------ DSA indexer

    @triton.jit
    def _indexer_scores_kernel(q_ptr, w_ptr, index_ptr, ape_ptr, idx_ptr, pos_ptr, out_ptr, IS_SLOT, IS_POS, P,
                               wscale, qscale, IH: tl.constexpr, BLOCK_IH: tl.constexpr, D: tl.constexpr,
                               BLOCK_D: tl.constexpr, KP: tl.constexpr, BP: tl.constexpr, F32: tl.constexpr):
        """Sequence b, pools [pb·BP, +BP): each pool's key (its tokens' keys weighed by the softmax over the pool of
        gate + ape, per channel, rounded as torch rounds them), relu(q·key·qscale) per indexer head, the heads'
        weighted sum; pools that end past the position get -inf."""
        b = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1) * BP + tl.arange(0, BP)
        pm = p < P
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        ty = index_ptr.dtype.element_ty
        slot = tl.load(idx_ptr + b).to(tl.int64)
        pos = tl.load(pos_ptr + b)
        rows = index_ptr + slot * IS_SLOT + (p * KP).to(tl.int64)[:, None] * IS_POS + d[None, :]    # [BP, D]
        m2 = pm[:, None] & dm[None, :]
        # The softmax over a pool's KP tokens in three passes over them ([BP, D] tiles, not [BP, KP, D]: registers):
        # the max, the sum of exps, then each token's rounded weight times its key.
        top = tl.zeros([BP, BLOCK_D], dtype=tl.float32) - float("inf")
        for j in range(KP):
            gj = tl.load(rows + j * IS_POS + D, mask=m2, other=0.0).to(tl.float32)
            top = tl.maximum(top, gj + tl.load(ape_ptr + j * D + d, mask=dm, other=0.0)[None, :])
        tot = tl.zeros([BP, BLOCK_D], dtype=tl.float32)
        for j in range(KP):
            gj = tl.load(rows + j * IS_POS + D, mask=m2, other=0.0).to(tl.float32)
            tot += tl.exp(gj + tl.load(ape_ptr + j * D + d, mask=dm, other=0.0)[None, :] - top)
        pool = tl.zeros([BP, BLOCK_D], dtype=tl.float32)
        for j in range(KP):
            gj = tl.load(rows + j * IS_POS + D, mask=m2, other=0.0).to(tl.float32)
            prob = (tl.exp(gj + tl.load(ape_ptr + j * D + d, mask=dm, other=0.0)[None, :] - top) / tot).to(ty)
            kj = tl.load(rows + j * IS_POS, mask=m2, other=0.0)
            pool += (prob.to(tl.float32) * kj.to(tl.float32)).to(ty).to(tl.float32)
        pool = pool.to(ty)                                                          # [BP, D]
        ih = tl.arange(0, BLOCK_IH)
        ihm = ih < IH
        q = tl.load(q_ptr + b * IH * D + ih[:, None] * D + d[None, :], mask=ihm[:, None] & dm[None, :], other=0.0)
        sc = _dot(q, tl.trans(pool), F32)
        sc = tl.maximum(sc * qscale, 0.0)                                         # [IH, BP]
        w = tl.load(w_ptr + b * IH + ih, mask=ihm, other=0.0).to(tl.float32) * wscale
        score = tl.sum(w[:, None] * sc, axis=0)
        score = tl.where(p * KP + KP - 1 <= pos, score, float("-inf"))
        tl.store(out_ptr + b * P + p, score, mask=pm)


def _f32_dots(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, iters: int,
           hc_eps: float, eps: float):
    """HyperConnection.__call__: streams [N, hc, H] (contiguous), fn [(2+hc)·hc, hc·H], base, scale (fp32) →
    (post [N, hc] fp32, comb [N, hc, hc] fp32, collapsed [N, H] in the streams' dtype). Two launches."""
    n, hc, hdim = streams.shape
    k, m = hc * hdim, fn.shape[0]
    streams, fn = streams.contiguous(), fn.contiguous()          # the kernels index rows: no-ops for the model's own
    block_m = _pow2(m)
    splits = min(HC_SPLITS, _pow2(triton.cdiv(k, HC_BLOCK_K)))
    chunk = triton.cdiv(triton.cdiv(k, splits), HC_BLOCK_K) * HC_BLOCK_K
    dev = streams.device
    part = torch.empty(n * splits, block_m, dtype=torch.float32, device=dev)
    sq = torch.empty(n * splits, dtype=torch.float32, device=dev)
    _hc_dots_kernel[(n, splits)](streams, fn, part, sq, k, chunk, M=m, BLOCK_M=block_m, BLOCK_K=HC_BLOCK_K,
                                 SPLITS=splits, num_warps=4)
    post = torch.empty(n, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=dev)
    out = torch.empty(n, hdim, dtype=streams.dtype, device=dev)
    block_t = min(_pow2(n), HC_TOKENS)
    block_h = max(64, HC_BLOCK_H * 4 // (block_t * _pow2(hc)))          # a [tokens, hc, hidden] tile of ~1K
    _hc_mix_kernel[(triton.cdiv(n, block_t), triton.cdiv(hdim, block_h))](
        streams, part, sq, base, scale, post, comb, out, n, k, hdim, eps, hc_eps, HC=hc, BLOCK_HC=_pow2(hc),
        ITERS=iters, BLOCK_M=block_m, SPLITS=splits, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)
    return post, comb, out


def hc_merge(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """HyperConnection.merge: post [N, hc], comb [N, hc, hc] fp32, out [N, H], streams [N, hc, H] → [N, hc, H]."""
    n, hc, hdim = streams.shape
    new = torch.empty_like(streams)
    _hc_merge_kernel[(n, triton.cdiv(hdim, HC_BLOCK_H))](streams, out.contiguous(), post, comb, new, hdim, HC=hc,
                                                         BLOCK_HC=_pow2(hc), BLOCK_H=HC_BLOCK_H, num_warps=4)
    return new


def kda_decode(mixed: torch.Tensor, f_b: torch.Tensor, b_proj: torch.Tensor, gate: torch.Tensor,
               conv_w: torch.Tensor, conv: torch.Tensor, state: torch.Tensor, idx: torch.Tensor, *,
               dt_bias: torch.Tensor, a_log: torch.Tensor, o_norm: torch.Tensor, lower: float | None,
               eps: float) -> torch.Tensor:
    """One token per sequence through a KDA layer, from its projections to the input of o_proj: mixed [B, 3·qkv]
    (q/k/v projections), f_b [B, qkv] (the forget gate's low-rank output), b_proj [B, heads], gate [B, qkv]
    (the output gate's), conv_w [3·qkv, kernel] fp32; conv [slots, 3·qkv, kernel-1] and state [slots, heads, d, d]
    (the layer's fp32 caches, advanced in place at slots idx [B]) → [B, qkv] in mixed's dtype."""
    bsz, heads = b_proj.shape
    d = o_norm.shape[0]
    assert conv.stride(2) == 1 and state[0].is_contiguous()
    out = torch.empty(bsz, heads * d, dtype=mixed.dtype, device=mixed.device)
    _kda_decode_kernel[(bsz, heads)](
        mixed.contiguous(), f_b.contiguous(), b_proj.contiguous(), gate.contiguous(), conv_w, conv, state, idx,
        dt_bias, a_log, o_norm, out, conv.stride(0), conv.stride(1), state.stride(0),
        0.0 if lower is None else float(lower), eps, d ** -0.5, HEADS=heads, D=d, BLOCK_D=_pow2(d), KERNEL=conv_w.shape[1],
        KP=_pow2(conv_w.shape[1] - 1),
        HAS_LOWER=lower is not None, num_warps=4)     # 8 warps: ptxas spills 18 KB a thread (sm_90, d 128)
    return out


def mla_decode(q: torch.Tensor, kv_b: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, keys: torch.Tensor,
               valid: torch.Tensor, *, nope: int, scale: float) -> torch.Tensor:
    """MLA of one query per sequence over its selected latent rows, projections absorbed: q [B, H, nope];
    kv_b [H·(nope+vd), R] (kv_b_proj's weight, [out, in]); latent [slots, max_len, R] (one layer's cache);
    keys, valid [B, S] (the DSA selection: positions and which of them count) → [B, H·vd] in q's dtype."""
    bsz, heads, _ = q.shape
    rank = latent.shape[-1]
    w = kv_b.view(heads, -1, rank)
    w_kb, w_vb = w[:, :nope], w[:, nope:]                                  # [H, nope, R], [H, vd, R]
    q_lat = torch.bmm(q.transpose(0, 1), w_kb)                              # [H, B, R]
    s = keys.shape[1]
    splits, chunk = attention_variant(s)
    block_r = max(16, _pow2(rank))                                          # tl.dot's least K
    o_lat = torch.empty(heads, bsz, rank, dtype=q.dtype, device=q.device)
    if splits == 1:
        part = ml = o_lat
    else:
        part = torch.empty(heads * bsz * splits, block_r, dtype=torch.float32, device=q.device)
        ml = torch.empty(heads * bsz * splits, 2, dtype=torch.float32, device=q.device)
    _mla_attention_kernel[(bsz, triton.cdiv(heads, MLA_HEADS), splits)](
        q_lat, latent, idx, keys.contiguous(), valid.contiguous().view(torch.uint8), o_lat, part, ml, q_lat.stride(0), q_lat.stride(1),
        latent.stride(0), latent.stride(1), o_lat.stride(0), o_lat.stride(1), s, scale, bsz, H=heads, R=rank,
        BLOCK_R=block_r, BH=MLA_HEADS, CHUNK=chunk, SPLITS=splits, BLOCK_N=MLA_KEYS,
        F32=_f32_dots(q.dtype), num_warps=8 if rank >= 256 else 4, num_stages=2)
    if splits > 1:
        _mla_combine_kernel[(heads * bsz,)](part, ml, o_lat, R=rank, BLOCK_R=block_r, SPLITS=splits, num_warps=4)
    o = torch.bmm(o_lat, w_vb.transpose(1, 2))                              # [H, B, vd]
    return o.transpose(0, 1).reshape(bsz, -1)


def warm_mla(kv_b: torch.Tensor, latent: torch.Tensor, sizes, *, heads: int, nope: int, scale: float) -> int:
    """Compile mla_decode for every selection size in `sizes` (its variants: engine.kernels.triton_decode.
    attention_variant of the size) now, one launch each over slot 0's first key (the output dropped; the cache
    only read), so a stream growing into a longer KV bucket does not stop mid-decode while Triton compiles (as
    triton_decode.warm_attention does for the other models). → variants launched."""
    first: dict[tuple, int] = {}
    for s in sizes:            # Triton also specialises an int argument on its divisibility by 16
        first.setdefault((attention_variant(s), s % 16 == 0), s)
    dev = latent.device
    q = torch.zeros(1, heads, nope, dtype=latent.dtype, device=dev)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    for s in first.values():
        mla_decode(q, kv_b, latent, zero, torch.zeros(1, s, dtype=torch.long, device=dev),
                   torch.ones(1, s, dtype=torch.bool, device=dev), nope=nope, scale=scale)
    return len(first)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, ape: torch.Tensor,
                   idx: torch.Tensor, pos: torch.Tensor, n_pools: int, kpool: int) -> torch.Tensor:
    """The DSA indexer's pooled scores of one query per sequence: q [B, IH, D] (wq_b's), weights [B, IH]
    (weights_proj's), index [slots, max_len, 2·D] (one layer's cache: key, pool gate), ape [kpool, D] fp32 →
    score [B, n_pools] fp32, -inf for the pools that end past the sequence's position pos [B]."""
    bsz, ih, dim = q.shape
    score = torch.empty(bsz, n_pools, dtype=torch.float32, device=q.device)
    _indexer_scores_kernel[(bsz, triton.cdiv(n_pools, INDEX_POOLS))](
        q.contiguous(), weights.contiguous(), index, ape, idx, pos, score, index.stride(0), index.stride(1), n_pools,
        ih ** -0.5, dim ** -0.5, IH=ih, BLOCK_IH=max(16, _pow2(ih)), D=dim, BLOCK_D=max(16, _pow2(dim)), KP=kpool,
        BP=INDEX_POOLS, F32=_f32_dots(q.dtype), num_warps=4)
    return score

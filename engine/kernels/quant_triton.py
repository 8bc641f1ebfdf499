"""Triton kernels for quantized expert records (rows order, engine.quant.records), slot-indexed like
engine.gpu.moe_kernels: the arena is [slots, record_bytes] uint8 and every kernel dequantizes the weights
it needs in registers, reading each record's bytes once — a 4-bit record moves a quarter of bf16's bytes.

  decode   GEMV kernels, one program per (pair, block of output rows): h = silu(gate x)·(up x), then
           y = w·(down h); out_t = Σ_k y[t·K + k]
  prefill  a grouped GEMM: the (token, expert) pairs sorted by slot and padded to BLOCK_M per expert, each
           program one BLOCK_M x BLOCK_N tile of one expert with tl.dot (tensor cores on sm_80+); int8/int4
           weights are unpacked a tile at a time (_weights_tile), BLOCK_M follows the pairs a slot has

Plain Triton (no TMA, no wgmma, no Hopper-only intrinsics): the same source runs on sm_86 and sm_90, and
through Triton's interpreter on CPU tensors in CI. Weights are dequantized to fp32 and rounded to the
model dtype (as the reference's `.to(x.dtype)` does) — except the int8/int4 decode GEMVs, which sum codes x
activations per group and scale once per group (_group_dot: the exact dequantized values, fewer operations
per byte); accumulation is fp32; g, u, silu and the expert
output are rounded to the model dtype where torch's F.linear rounds them. Every kernel equals
quant_moe_reference (a plain dequantize-then-matmul of the same records) to that rounding
(tests/engine/test_quant.py).
"""
from __future__ import annotations

import torch

from engine.experts.reference import moe_reference
from engine.kernels import import_triton
from engine.kernels.triton_common import GEMV_MAX_PAIRS, limit_arg, sum_picks, table_args
from engine.quant import ggml
from engine.quant.records import GGUF_BLOCK, QuantLayout, group_size

# Triton ships with CUDA builds of torch; CPU-only installs use the reference path (and do not import triton at all).
triton, tl = import_triton()

FMT = {"int8": 0, "int4": 1, "q8_0": 2, "q4_1": 3, "q4_k": 4}
MIXED_FMT = 5          # a ggml: record: each matrix's GGML type read from the record's header (_ggml_weights)
TYPED_FMT = 6          # GGUF blocks whose three GGML types the launch names (constexprs): _ggml_sub's sub-blocks
# Weights per sub-block (one scale and offset each) of every GGML type in _ggml_sub: the K-quants' 16- or 32-weight
# sub-blocks, the 32-weight types' nibble halves (q4_0 … iq4_nl), 32 for q8_0 and the float types.
SUB = {"f32": 32, "f16": 32, "bf16": 32, "q8_0": 32, "q4_0": 16, "q4_1": 16, "q5_0": 16, "q5_1": 16, "iq4_nl": 16,
       "q4_k": 32, "q5_k": 32, "q2_k": 16, "q3_k": 16, "q6_k": 16, "iq4_xs": 16}


def available(device: torch.device) -> bool:
    import os
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def _row_bytes(scheme: str, inp: int) -> int:
    if scheme in GGUF_BLOCK:
        per, size = GGUF_BLOCK[scheme]
        return inp // per * size
    return inp if scheme == "int8" else inp // 2


if triton is not None:
    from engine.kernels.triton_common import record_ptr, swiglu      # jitted: they exist only with Triton

    @triton.jit
    def _fp16_at(p):
        return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)

    @triton.jit
    def _record_types(rec, FMT: tl.constexpr):
        """(gate, up, down) GGML type codes of a ggml: record (its header's bytes 4..6), else zeros (unused)."""
        if FMT == 5:
            return tl.load(rec + 4).to(tl.int32), tl.load(rec + 5).to(tl.int32), tl.load(rec + 6).to(tl.int32)
        return 0, 0, 0

    @triton.jit
    def _byte(p, m):
        return tl.load(p, mask=m, other=0).to(tl.int32)

    @triton.jit
    def _iq4_value(q):
        """IQ4_NL's non-linear code book (engine.quant.ggml.IQ4_NL_VALUES) at codes q (0..15)."""
        lo = tl.where(q < 4, tl.where(q < 2, tl.where(q == 0, -127, -104), tl.where(q == 2, -83, -65)),
                      tl.where(q < 6, tl.where(q == 4, -49, -35), tl.where(q == 6, -22, -10)))
        hi = tl.where(q < 12, tl.where(q < 10, tl.where(q == 8, 1, 13), tl.where(q == 10, 25, 38)),
                      tl.where(q < 14, tl.where(q == 12, 53, 69), tl.where(q == 14, 89, 113)))
        return tl.where(q < 8, lo, hi).to(tl.float32)

    @triton.jit
    def _ggml_weights(mat, r, k, m, IN: tl.constexpr, T):
        """fp32 W[r, k] of a GGUF matrix of GGML type T (a runtime code, one per program: the branch is uniform)
        starting at byte pointer `mat`, element by element as gguf.quants.dequantize computes it (the block
        layouts: engine.quant.ggml)."""
        w = (r * 0 + k * 0).to(tl.float32)
        if T == 0:        # f32
            w = tl.load((mat + (r * IN + k) * 4).to(tl.pointer_type(tl.float32)), mask=m, other=0.0)
        elif T == 1:      # f16
            w = tl.load((mat + (r * IN + k) * 2).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
        elif T == 30:     # bf16
            w = tl.load((mat + (r * IN + k) * 2).to(tl.pointer_type(tl.bfloat16)), mask=m, other=0.0).to(tl.float32)
        elif (T == 2) | (T == 20):     # q4_0, iq4_nl: d | 16 bytes (weight i < 16 the low nibble of byte i)
            blk = mat + r * (IN // 32 * 18) + (k // 32) * 18
            i = k % 32
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            q = (_byte(blk + 2 + i % 16, m) >> ((i // 16) * 4)) & 15
            if T == 2:
                w = d * (q - 8).to(tl.float32)
            else:
                w = d * _iq4_value(q)
        elif T == 3:      # q4_1
            blk = mat + r * (IN // 32 * 20) + (k // 32) * 20
            i = k % 32
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            mn = tl.load((blk + 2).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            w = d * ((_byte(blk + 4 + i % 16, m) >> ((i // 16) * 4)) & 15).to(tl.float32) + mn
        elif (T == 6) | (T == 7):      # q5_0 (d | qh | qs), q5_1 (d | m | qh | qs)
            size = tl.where(T == 6, 22, 24)
            blk = mat + r * (IN // 32 * size) + (k // 32) * size
            i = k % 32
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            qh_at = tl.where(T == 6, 2, 4)
            hb = (_byte(blk + qh_at + i // 8, m) >> (i % 8)) & 1
            lo = (_byte(blk + qh_at + 4 + i % 16, m) >> ((i // 16) * 4)) & 15
            q = lo | (hb << 4)
            if T == 6:
                w = d * (q - 16).to(tl.float32)
            else:
                mn = tl.load((blk + 2).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
                w = d * q.to(tl.float32) + mn
        elif T == 8:      # q8_0
            blk = mat + r * (IN // 32 * 34) + (k // 32) * 34
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            w = tl.load((blk + 2 + k % 32).to(tl.pointer_type(tl.int8)), mask=m, other=0).to(tl.float32) * d
        elif T == 10:     # q2_k: scales 16 | qs 64 | d | dmin
            blk = mat + r * (IN // 256 * 84) + (k // 256) * 84
            i = k % 256
            d = tl.load((blk + 80).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            dmin = tl.load((blk + 82).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            sc = _byte(blk + i // 16, m)
            q = (_byte(blk + 16 + (i // 128) * 32 + i % 32, m) >> (2 * ((i % 128) // 32))) & 3
            w = (d * (sc & 15).to(tl.float32)) * q.to(tl.float32) - dmin * (sc >> 4).to(tl.float32)
        elif T == 11:     # q3_k: hmask 32 | qs 64 | scales 12 | d
            blk = mat + r * (IN // 256 * 110) + (k // 256) * 110
            i = k % 256
            s = i // 16
            d = tl.load((blk + 108).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            lo = (_byte(blk + 96 + s % 8, m) >> (4 * (s // 8))) & 15
            hi = (_byte(blk + 104 + s % 4, m) >> (2 * (s // 4))) & 3
            sc = ((lo | (hi << 4)) - 32).to(tl.float32)
            ql = (_byte(blk + 32 + (i // 128) * 32 + i % 32, m) >> (2 * ((i % 128) // 32))) & 3
            bit = (_byte(blk + i % 32, m) >> (i // 32)) & 1
            w = (d * sc) * (ql - 4 * (1 - bit)).to(tl.float32)
        elif (T == 12) | (T == 13):    # q4_k, q5_k: d | dmin | scales 12 | (qh 32 |) qs 128
            size = tl.where(T == 12, 144, 176)
            blk = mat + r * (IN // 256 * size) + (k // 256) * size
            i = k % 256
            j = i // 32
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            dmin = tl.load((blk + 2).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            lo4 = j < 4
            s_j = _byte(blk + 4 + j, m)
            s_j4 = _byte(blk + 8 + j, m)
            s_jm4 = _byte(blk + 4 + tl.where(lo4, 0, j - 4), m)
            sc = tl.where(lo4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
            mn = tl.where(lo4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
            qs_at = tl.where(T == 12, 16, 48)
            q = (_byte(blk + qs_at + (j // 2) * 32 + i % 32, m) >> ((j % 2) * 4)) & 15
            if T == 13:
                q = q | (((_byte(blk + 16 + i % 32, m) >> j) & 1) << 4)
            w = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)
        elif T == 14:     # q6_k: ql 128 | qh 64 | scales 16 (int8) | d
            blk = mat + r * (IN // 256 * 210) + (k // 256) * 210
            i = k % 256
            h = i // 128
            rr = i % 128
            d = tl.load((blk + 208).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            ql = (_byte(blk + h * 64 + rr % 64, m) >> (4 * (rr // 64))) & 15
            qh = (_byte(blk + 128 + h * 32 + rr % 32, m) >> (2 * (rr // 32))) & 3
            sc = tl.load((blk + 192 + i // 16).to(tl.pointer_type(tl.int8)), mask=m, other=0).to(tl.float32)
            w = (d * sc) * ((ql | (qh << 4)) - 32).to(tl.float32)
        elif T == 23:     # iq4_xs: d | scales_h u16 | scales_l 4 | qs 128 (per 32 weights: 16 bytes as iq4_nl)
            blk = mat + r * (IN // 256 * 136) + (k // 256) * 136
            i = k % 256
            j = i // 32
            rr = i % 32
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            sh = _byte(blk + 2, m) | (_byte(blk + 3, m) << 8)
            ls = (_byte(blk + 4 + j // 2, m) >> (4 * (j % 2))) & 15
            hs = (sh >> (2 * j)) & 3
            dl = d * ((ls | (hs << 4)) - 32).to(tl.float32)
            q = (_byte(blk + 8 + 16 * j + rr % 16, m) >> (4 * (rr // 16))) & 15
            w = dl * _iq4_value(q)
        return w

    @triton.jit
    def _ggml_sub(mat, r64, rmask, m0, IN: tl.constexpr, T: tl.constexpr, R: tl.constexpr, M: tl.constexpr,
                  S: tl.constexpr):
        """Sub-blocks m0..m0+M-1 (S weights each, SUB[type]) of rows r64 of a GGUF matrix of GGML type T (a
        constexpr: one compile per type) at byte pointer `mat`, as (q [R, M, S], s [R, M], z [R, M]) fp32 with
        W[r, (m0+m)·S + l] = s·q + z — every GGML type is one scale and one offset per sub-block over its codes, so
        codes load S contiguous bytes a sub-block (vectorised) and scales once a sub-block, not per weight as
        _ggml_weights gathers them. Rows past rmask and sub-blocks past IN give zeros (s = z = 0)."""
        mm = m0 + tl.arange(0, M)
        l = tl.arange(0, S)[None, None, :]
        m2 = rmask[:, None] & (mm < IN // S)[None, :]
        m3 = m2[:, :, None]
        z = tl.zeros([R, M], dtype=tl.float32)
        if (T == 0) | (T == 1) | (T == 30):        # f32, f16, bf16: q the weight itself, s = 1
            e = r64[:, None, None] * IN + mm[None, :, None] * S + l
            if T == 0:
                q = tl.load(mat.to(tl.pointer_type(tl.float32)) + e, mask=m3, other=0.0)
            elif T == 1:
                q = tl.load(mat.to(tl.pointer_type(tl.float16)) + e, mask=m3, other=0.0).to(tl.float32)
            else:
                q = tl.load(mat.to(tl.pointer_type(tl.bfloat16)) + e, mask=m3, other=0.0).to(tl.float32)
            s = m2.to(tl.float32)
        elif T == 8:      # q8_0 (32, 34): d | 32 int8; one sub-block a block
            blk = mat + r64[:, None] * (IN // 32 * 34) + (mm * 34)[None, :]
            s = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
            q = tl.load((blk + 2)[:, :, None].to(tl.pointer_type(tl.int8)) + l, mask=m3, other=0).to(tl.float32)
        elif (T == 2) | (T == 3) | (T == 6) | (T == 7) | (T == 20):   # 32-weight blocks of nibbles: 2 sub-blocks
            SIZE: tl.constexpr = 18 if (T == 2) | (T == 20) else (20 if T == 3 else (22 if T == 6 else 24))
            QS: tl.constexpr = 2 if (T == 2) | (T == 20) else (4 if T == 3 else (6 if T == 6 else 8))
            hh = (mm % 2)[None, :]                 # sub-block h: weights 16h.. = the low (h 0) or high nibbles
            blk = mat + r64[:, None] * (IN // 32 * SIZE) + ((mm // 2) * SIZE)[None, :]
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
            b = tl.load((blk + QS)[:, :, None] + l, mask=m3, other=0).to(tl.int32)
            q = (b >> (4 * hh)[:, :, None]) & 15
            if (T == 6) | (T == 7):                # the fifth bit: qh (u32) bit 16h + l, byte 2h + l // 8
                qh = tl.load((blk + (QS - 4) + 2 * hh)[:, :, None] + l // 8, mask=m3, other=0).to(tl.int32)
                q = q | (((qh >> (l % 8)) & 1) << 4)
            s = d
            if T == 2:
                q = (q - 8).to(tl.float32)
            elif T == 6:
                q = (q - 16).to(tl.float32)
            elif T == 20:
                q = _iq4_value(q)
            else:                                  # q4_1, q5_1: + m
                q = q.to(tl.float32)
                z = tl.load((blk + 2).to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
        elif (T == 12) | (T == 13):                # q4_k, q5_k: d | dmin | scales 12 | (qh 32 |) qs 128; 8 of 32
            SIZE: tl.constexpr = 144 if T == 12 else 176
            j = (mm % 8)[None, :]
            blk = mat + r64[:, None] * (IN // 256 * SIZE) + ((mm // 8) * SIZE)[None, :]
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
            dmin = tl.load((blk + 2).to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
            lo4 = j < 4
            s_j = _byte(blk + 4 + j, m2)
            s_j4 = _byte(blk + 8 + j, m2)
            s_jm4 = _byte(blk + 4 + tl.where(lo4, 0, j - 4), m2)
            sc = tl.where(lo4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))          # ggml's get_scale_min_k4
            mn = tl.where(lo4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
            QS: tl.constexpr = 16 if T == 12 else 48
            b = tl.load((blk + QS + (j // 2) * 32)[:, :, None] + l, mask=m3, other=0).to(tl.int32)
            q = (b >> ((j % 2) * 4)[:, :, None]) & 15
            if T == 13:
                qh = tl.load((blk + 16)[:, :, None] + l, mask=m3, other=0).to(tl.int32)
                q = q | (((qh >> j[:, :, None]) & 1) << 4)
            q = q.to(tl.float32)
            s = d * sc.to(tl.float32)
            z = -dmin * mn.to(tl.float32)
        elif T == 14:     # q6_k (256, 210): ql 128 | qh 64 | 16 int8 scales | d; sub-block t of 16: weights 16t..
            t = (mm % 16)[None, :]
            blk = mat + r64[:, None] * (IN // 256 * 210) + ((mm // 16) * 210)[None, :]
            half = t // 8
            ql = tl.load((blk + half * 64 + (t % 4) * 16)[:, :, None] + l, mask=m3, other=0).to(tl.int32)
            qh = tl.load((blk + 128 + half * 32 + (t % 2) * 16)[:, :, None] + l, mask=m3, other=0).to(tl.int32)
            q = ((ql >> (4 * ((t % 8) // 4))[:, :, None]) & 15) | (((qh >> (2 * ((t % 8) // 2))[:, :, None]) & 3) << 4)
            q = (q - 32).to(tl.float32)
            d = tl.load((blk + 208).to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
            s = d * tl.load((blk + 192 + t).to(tl.pointer_type(tl.int8)), mask=m2, other=0).to(tl.float32)
        elif T == 10:     # q2_k (256, 84): scales 16 | qs 64 | d | dmin; per 16: w = d·(sc & 15)·q − dmin·(sc >> 4)
            t = (mm % 16)[None, :]
            blk = mat + r64[:, None] * (IN // 256 * 84) + ((mm // 16) * 84)[None, :]
            b = tl.load((blk + 16 + (t // 8) * 32 + (t % 2) * 16)[:, :, None] + l, mask=m3, other=0).to(tl.int32)
            q = ((b >> (2 * ((t % 8) // 2))[:, :, None]) & 3).to(tl.float32)
            sc = _byte(blk + t, m2)
            d = tl.load((blk + 80).to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
            dmin = tl.load((blk + 82).to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
            s = d * (sc & 15).to(tl.float32)
            z = -dmin * (sc >> 4).to(tl.float32)
        elif T == 11:     # q3_k (256, 110): hmask 32 | qs 64 | scales 12 | d; per 16: w = d·sc·(q − 4·!bit)
            t = (mm % 16)[None, :]
            blk = mat + r64[:, None] * (IN // 256 * 110) + ((mm // 16) * 110)[None, :]
            b = tl.load((blk + 32 + (t // 8) * 32 + (t % 2) * 16)[:, :, None] + l, mask=m3, other=0).to(tl.int32)
            ql = (b >> (2 * ((t % 8) // 2))[:, :, None]) & 3
            hm = tl.load((blk + (t % 2) * 16)[:, :, None] + l, mask=m3, other=0).to(tl.int32)
            bit = (hm >> (t // 2)[:, :, None]) & 1
            q = (ql - 4 * (1 - bit)).to(tl.float32)
            lo = (_byte(blk + 96 + t % 8, m2) >> (4 * (t // 8))) & 15
            hi = (_byte(blk + 104 + t % 4, m2) >> (2 * (t // 4))) & 3
            d = tl.load((blk + 108).to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
            s = d * ((lo | (hi << 4)) - 32).to(tl.float32)
        else:             # iq4_xs (23; 256, 136): d | scales_h u16 | scales_l 4 | qs 128 (per 32: 16 bytes, iq4_nl's)
            t = (mm % 16)[None, :]
            j = t // 2
            blk = mat + r64[:, None] * (IN // 256 * 136) + ((mm // 16) * 136)[None, :]
            b = tl.load((blk + 8 + 16 * j)[:, :, None] + l, mask=m3, other=0).to(tl.int32)
            q = _iq4_value((b >> (4 * (t % 2))[:, :, None]) & 15)
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
            sh = _byte(blk + 2, m2) | (_byte(blk + 3, m2) << 8)
            ls = (_byte(blk + 4 + j // 2, m2) >> (4 * (j % 2))) & 15
            hs = (sh >> (2 * j)) & 3
            s = d * ((ls | (hs << 4)) - 32).to(tl.float32)
        return q, s, z

    @triton.jit
    def _k4_scale_min(blk, j, m):
        """Q4_K / Q5_K sub-block j's 6-bit (scale, min) from the 12 scale bytes at blk + 4 (ggml's get_scale_min_k4)."""
        lo4 = j < 4
        s_j = _byte(blk + 4 + j, m)
        s_j4 = _byte(blk + 8 + j, m)                                  # s[j + 4]: j + 4 <= 11
        s_jm4 = _byte(blk + 4 + tl.where(lo4, 0, j - 4), m)
        sc = tl.where(lo4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
        mn = tl.where(lo4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _q4_k_dot(mat, r64, rmask, x_row, k0, IN: tl.constexpr, R: tl.constexpr, CHUNK: tl.constexpr):
        """_ggml_dot for Q4_K: each 32-byte run of codes loaded once for the two sub-blocks it holds (its low nibbles
        sub-block 2c, its high ones 2c + 1), where _ggml_sub's sub-block form reads it twice."""
        P: tl.constexpr = CHUNK // 64
        ci = k0 // 64 + tl.arange(0, P)                        # 64-weight chunks: block ci // 4, pair ci % 4
        cm = ci < IN // 64
        m2 = rmask[:, None] & cm[None, :]
        c = (ci % 4)[None, :]
        blk = mat + r64[:, None] * (IN // 256 * 144) + ((ci // 4) * 144)[None, :]
        d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
        dmin = tl.load((blk + 2).to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
        sc_lo, mn_lo = _k4_scale_min(blk, 2 * c, m2)
        sc_hi, mn_hi = _k4_scale_min(blk, 2 * c + 1, m2)
        l = tl.arange(0, 32)
        b = tl.load((blk + 16 + c * 32)[:, :, None] + l[None, None, :], mask=m2[:, :, None], other=0).to(tl.int32)
        xp = x_row + ci[:, None] * 64 + l[None, :]
        x_lo = tl.load(xp, mask=cm[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(xp + 32, mask=cm[:, None], other=0.0).to(tl.float32)
        d_lo = tl.sum((b & 15).to(tl.float32) * x_lo[None, :, :], axis=2)
        d_hi = tl.sum((b >> 4).to(tl.float32) * x_hi[None, :, :], axis=2)
        s_lo = tl.sum(x_lo, axis=1)[None, :]
        s_hi = tl.sum(x_hi, axis=1)[None, :]
        return tl.sum(d * (sc_lo * d_lo + sc_hi * d_hi) - dmin * (mn_lo * s_lo + mn_hi * s_hi), axis=1)

    @triton.jit
    def _ggml_dot(mat, r64, rmask, x_row, k0, IN: tl.constexpr, T: tl.constexpr, S: tl.constexpr, R: tl.constexpr,
                  CHUNK: tl.constexpr, PAIRS: tl.constexpr = True):
        """Σ_k W[rows, k]·x[k] over k0..k0+CHUNK-1 of a GGUF matrix of type T: per sub-block Σ q·x, then s·that +
        z·Σ x (each sub-block scaled once, as _group_dot does int4's groups); Q4_K by _q4_k_dot (PAIRS, CHUNK >= 64)."""
        if (T == 12) & PAIRS & (CHUNK >= 64):
            acc = _q4_k_dot(mat, r64, rmask, x_row, k0, IN, R, CHUNK)
        else:
            M: tl.constexpr = CHUNK // S
            q, s, z = _ggml_sub(mat, r64, rmask, k0 // S, IN, T, R, M, S)
            mm = k0 // S + tl.arange(0, M)
            xv = tl.load(x_row + mm[:, None] * S + tl.arange(0, S)[None, :], mask=(mm < IN // S)[:, None],
                         other=0.0).to(tl.float32)
            dq = tl.sum(q * xv[None, :, :], axis=2)
            acc = tl.sum(s * dq + z * tl.sum(xv, axis=1)[None, :], axis=1)
        return acc

    @triton.jit
    def _ggml_tile(mat, rows, rmask, k0, IN: tl.constexpr, T: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
        """fp32 W[rows, k0:k0+BLOCK_K] of a GGUF matrix of type T (BLOCK_K a multiple of S): the grouped GEMM's tile,
        its sub-blocks by _ggml_sub."""
        q, s, z = _ggml_sub(mat, rows.to(tl.int64), rmask, k0 // S, IN, T, BLOCK_N, BLOCK_K // S, S)
        return tl.reshape(q * s[:, :, None] + z[:, :, None], (BLOCK_N, BLOCK_K))

    @triton.jit
    def _gate_up_gemv_ggml(x_ptr, arena_ptr, slot_ptr, h_ptr, SLOT_OFF, table_ptr, log_ptr, K: tl.constexpr,
                           H: tl.constexpr, I: tl.constexpr, REC: tl.constexpr, TABLE: tl.constexpr, LOG: tl.constexpr,
                           GATE: tl.constexpr, UP: tl.constexpr, TG: tl.constexpr, TU: tl.constexpr,
                           SG: tl.constexpr, SU: tl.constexpr, BLOCK_I: tl.constexpr, CHUNK: tl.constexpr,
                           LIMIT: tl.constexpr = 0.0, PAIRS: tl.constexpr = True):
        p = tl.program_id(0)
        rec = record_ptr(arena_ptr, slot_ptr, table_ptr, log_ptr, p, SLOT_OFF, REC, TABLE, LOG)
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        rmask = rows < I
        r64 = rows.to(tl.int64)
        x_row = x_ptr + (p // K) * H
        acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
        for k0 in range(0, H, CHUNK):
            acc_g += _ggml_dot(rec + GATE, r64, rmask, x_row, k0, H, TG, SG, BLOCK_I, CHUNK, PAIRS)
            acc_u += _ggml_dot(rec + UP, r64, rmask, x_row, k0, H, TU, SU, BLOCK_I, CHUNK, PAIRS)
        tl.store(h_ptr + p * I + rows, swiglu(acc_g, acc_u, h_ptr.dtype.element_ty, LIMIT), mask=rmask)

    @triton.jit
    def _down_gemv_ggml(h_ptr, arena_ptr, slot_ptr, w_ptr, y_ptr, SLOT_OFF, table_ptr, H: tl.constexpr,
                        I: tl.constexpr, REC: tl.constexpr, TABLE: tl.constexpr, DOWN: tl.constexpr, TD: tl.constexpr,
                        SD: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK: tl.constexpr, PAIRS: tl.constexpr = True):
        p = tl.program_id(0)
        rec = record_ptr(arena_ptr, slot_ptr, table_ptr, slot_ptr, p, SLOT_OFF, REC, TABLE, False)
        rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        rmask = rows < H
        r64 = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k0 in range(0, I, CHUNK):
            acc += _ggml_dot(rec + DOWN, r64, rmask, h_ptr + p * I, k0, I, TD, SD, BLOCK_H, CHUNK, PAIRS)
        acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + p).to(tl.float32)
        tl.store(y_ptr + p * H + rows, acc * w, mask=rmask)

    @triton.jit
    def _weights(mat, rows, ks, m, OUT: tl.constexpr, IN: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, T):
        """fp32 W[rows, ks] of one rows-form matrix starting at byte pointer `mat` (masked by m); T: its GGML type
        code where FMT is MIXED_FMT (read from the record's header), else unused."""
        r = rows[:, None].to(tl.int64)
        k = ks[None, :]
        if FMT == 5:
            w = _ggml_weights(mat, r, k, m, IN, T)
        elif FMT == 0:      # int8: q [OUT, IN] int8 | s fp16 [OUT, IN/G]
            q = tl.load((mat + r * IN + k).to(tl.pointer_type(tl.int8)), mask=m, other=0).to(tl.float32)
            s = tl.load((mat + OUT * IN + (r * (IN // G) + k // G) * 2).to(tl.pointer_type(tl.float16)),
                        mask=m, other=0.0).to(tl.float32)
            w = q * s
        elif FMT == 1:    # int4: codes [OUT, IN/2] | (s, z) bf16 [OUT, IN/G, 2]; w = (q - 8)s + z
            b = tl.load(mat + r * (IN // 2) + k // 2, mask=m, other=0).to(tl.int32)
            q = ((b >> ((k % 2) * 4)) & 15).to(tl.float32)
            sz = (mat + OUT * (IN // 2) + (r * (IN // G) + k // G) * 4).to(tl.pointer_type(tl.bfloat16))
            s = tl.load(sz, mask=m, other=0.0).to(tl.float32)
            z = tl.load(sz + 1, mask=m, other=0.0).to(tl.float32)
            w = (q - 8.0) * s + z
        elif FMT == 2:    # q8_0: blocks of 34 bytes: d fp16, 32 x int8
            blk = mat + r * (IN // 32 * 34) + (k // 32) * 34
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            q = tl.load((blk + 2 + k % 32).to(tl.pointer_type(tl.int8)), mask=m, other=0).to(tl.float32)
            w = d * q
        elif FMT == 3:    # q4_1: blocks of 20 bytes: d, m fp16, 16 bytes (low nibbles 0..15, high 16..31)
            blk = mat + r * (IN // 32 * 20) + (k // 32) * 20
            i = k % 32
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            mn = tl.load((blk + 2).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            b = tl.load(blk + 4 + i % 16, mask=m, other=0).to(tl.int32)
            w = d * ((b >> ((i // 16) * 4)) & 15).to(tl.float32) + mn
        else:             # q4_k: blocks of 144 bytes over 256: d, dmin fp16, 12 bytes of 6-bit scales, 128 of codes
            blk = mat + r * (IN // 256 * 144) + (k // 256) * 144
            j = (k % 256) // 32
            d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            dmin = tl.load((blk + 2).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
            lo = j < 4
            s_j = tl.load(blk + 4 + j, mask=m, other=0).to(tl.int32)
            s_j4 = tl.load(blk + 8 + j, mask=m, other=0).to(tl.int32)                       # j + 4 <= 11
            s_jm4 = tl.load(blk + 4 + tl.where(lo, 0, j - 4), mask=m, other=0).to(tl.int32)
            # j < 4: sc = s[j] & 63, mn = s[j+4] & 63; else sc = s[j+4] & 15 | (s[j-4] >> 6) << 4,
            #        mn = s[j+4] >> 4 | (s[j] >> 6) << 4   (ggml's get_scale_min_k4)
            sc = tl.where(lo, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
            mn = tl.where(lo, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
            b = tl.load(blk + 16 + (j // 2) * 32 + k % 32, mask=m, other=0).to(tl.int32)
            q = ((b >> ((j % 2) * 4)) & 15).to(tl.float32)
            w = (d * sc.to(tl.float32)) * q - dmin * mn.to(tl.float32)
        return w

    @triton.jit
    def _weights_tile(mat, rows, rmask, k0, OUT: tl.constexpr, IN: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 W[rows, k0:k0+BLOCK_K] of an int8/int4 rows-form matrix (BLOCK_K a multiple of G; k past IN and rows
        masked give 0): a row's codes in one contiguous load and one scale (and zero) a group, where _weights
        gathers codes, scales and zeros per element. The same values as _weights: (q − 8)·s + z, q·s in fp32."""
        KG: tl.constexpr = BLOCK_K // G
        r = rows[:, None].to(tl.int64)
        gi = k0 // G + tl.arange(0, KG)
        gm = rmask[:, None] & (gi < IN // G)[None, :]
        if FMT == 0:      # int8: q [OUT, IN] int8 | s fp16 [OUT, IN/G]
            k = k0 + tl.arange(0, BLOCK_K)
            q = tl.load((mat + r * IN + k[None, :]).to(tl.pointer_type(tl.int8)),
                        mask=rmask[:, None] & (k < IN)[None, :], other=0).to(tl.float32)
            s = tl.load((mat + OUT * IN + (r * (IN // G) + gi[None, :]) * 2).to(tl.pointer_type(tl.float16)),
                        mask=gm, other=0.0).to(tl.float32)
            w = tl.reshape(q, (BLOCK_N, KG, G)) * s[:, :, None]
        else:             # int4: codes [OUT, IN/2] (even k the low nibble) | (s, z) bf16 [OUT, IN/G, 2]
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b = tl.load(mat + r * (IN // 2) + j[None, :], mask=rmask[:, None] & (j < IN // 2)[None, :],
                        other=0).to(tl.int32)
            q = tl.interleave(b & 15, b >> 4).to(tl.float32)
            sz = (mat + OUT * (IN // 2) + (r * (IN // G) + gi[None, :]) * 4).to(tl.pointer_type(tl.bfloat16))
            s = tl.load(sz, mask=gm, other=0.0).to(tl.float32)
            z = tl.load(sz + 1, mask=gm, other=0.0).to(tl.float32)
            w = (tl.reshape(q, (BLOCK_N, KG, G)) - 8.0) * s[:, :, None] + z[:, :, None]
        return tl.reshape(w, (BLOCK_N, BLOCK_K))

    @triton.jit
    def _gate_up_gemv(x_ptr, arena_ptr, slot_ptr, h_ptr, SLOT_OFF, table_ptr, log_ptr, K: tl.constexpr,
                      H: tl.constexpr, I: tl.constexpr, REC: tl.constexpr, TABLE: tl.constexpr, LOG: tl.constexpr,
                      GATE: tl.constexpr, UP: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr,
                      BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, LIMIT: tl.constexpr = 0.0):
        p = tl.program_id(0)
        t = p // K
        rec = record_ptr(arena_ptr, slot_ptr, table_ptr, log_ptr, p, SLOT_OFF, REC, TABLE, LOG)
        tg, tu, td = _record_types(rec, FMT)
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        rmask = rows < I
        out_ty = h_ptr.dtype.element_ty
        acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            cmask = cols < H
            xv = tl.load(x_ptr + t * H + cols, mask=cmask, other=0.0).to(tl.float32)
            m = rmask[:, None] & cmask[None, :]
            g = _weights(rec + GATE, rows, cols, m, I, H, FMT, G, tg).to(out_ty).to(tl.float32)
            acc_g += tl.sum(g * xv[None, :], axis=1)
            u = _weights(rec + UP, rows, cols, m, I, H, FMT, G, tu).to(out_ty).to(tl.float32)
            acc_u += tl.sum(u * xv[None, :], axis=1)
        tl.store(h_ptr + p * I + rows, swiglu(acc_g, acc_u, out_ty, LIMIT), mask=rmask)

    @triton.jit
    def _down_gemv(h_ptr, arena_ptr, slot_ptr, w_ptr, y_ptr, SLOT_OFF, table_ptr, H: tl.constexpr, I: tl.constexpr,
                   REC: tl.constexpr, TABLE: tl.constexpr, DOWN: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr):
        p = tl.program_id(0)
        rec = record_ptr(arena_ptr, slot_ptr, table_ptr, slot_ptr, p, SLOT_OFF, REC, TABLE, False)
        tg, tu, td = _record_types(rec, FMT)
        rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        rmask = rows < H
        out_ty = h_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            cmask = cols < I
            hv = tl.load(h_ptr + p * I + cols, mask=cmask, other=0.0).to(tl.float32)
            d = _weights(rec + DOWN, rows, cols, rmask[:, None] & cmask[None, :], H, I, FMT, G, td)
            acc += tl.sum(d.to(out_ty).to(tl.float32) * hv[None, :], axis=1)
        acc = acc.to(out_ty).to(tl.float32)          # the expert output in the model dtype, then weighted
        w = tl.load(w_ptr + p).to(tl.float32)
        tl.store(y_ptr + p * H + rows, acc * w, mask=rmask)

    @triton.jit
    def _group_dot(mat, r64, rmask, x_row, g0, OUT: tl.constexpr, IN: tl.constexpr, FMT: tl.constexpr,
                   G: tl.constexpr, R: tl.constexpr, SPAN: tl.constexpr):
        """Σ_k W[rows, k]·x[k] over groups g0..g0+SPAN-1 of an int8/int4 rows-form matrix (those past IN/G masked),
        each group scaled once: s·Σ q·x (int8) and s·(Σ q·x − 8·Σ x) + z·Σ x (int4). Codes are read as the bytes
        they are, contiguously, SPAN groups per load: a decode GEMV is bound by load latency, so the fewer, larger
        loads the better (an [R, SPAN, bytes a group] tile instead of this flat load and reshape measured slower
        on the H200: results/2026-12-03-h200-decode-kernels.json, the tile31 rows)."""
        gi = g0 + tl.arange(0, SPAN)
        gm = gi < IN // G
        m2 = rmask[:, None] & gm[None, :]
        if FMT == 0:
            jk = tl.arange(0, SPAN * G)
            km = g0 * G + jk < IN
            xv = tl.load(x_row + g0 * G + jk, mask=km, other=0.0).to(tl.float32)
            q = tl.load((mat + r64[:, None] * IN + g0 * G + jk[None, :]).to(tl.pointer_type(tl.int8)),
                        mask=rmask[:, None] & km[None, :], other=0).to(tl.float32)
            d = tl.sum(tl.reshape(q * xv[None, :], (R, SPAN, G)), axis=2)
            s = tl.load((mat + OUT * IN + (r64[:, None] * (IN // G) + gi[None, :]) * 2).to(tl.pointer_type(tl.float16)),
                        mask=m2, other=0.0).to(tl.float32)
            return tl.sum(s * d, axis=1)
        else:
            jb = tl.arange(0, SPAN * G // 2)
            km = g0 * (G // 2) + jb < IN // 2
            xe = tl.load(x_row + g0 * G + 2 * jb, mask=km, other=0.0).to(tl.float32)
            xo = tl.load(x_row + g0 * G + 2 * jb + 1, mask=km, other=0.0).to(tl.float32)
            b = tl.load(mat + r64[:, None] * (IN // 2) + g0 * (G // 2) + jb[None, :],
                        mask=rmask[:, None] & km[None, :], other=0).to(tl.int32)
            prod = (b & 15).to(tl.float32) * xe[None, :] + (b >> 4).to(tl.float32) * xo[None, :]
            d = tl.sum(tl.reshape(prod, (R, SPAN, G // 2)), axis=2)
            xs = tl.sum(tl.reshape(xe + xo, (SPAN, G // 2)), axis=1)
            sz = (mat + OUT * (IN // 2) + (r64[:, None] * (IN // G) + gi[None, :]) * 4).to(tl.pointer_type(tl.bfloat16))
            s = tl.load(sz, mask=m2, other=0.0).to(tl.float32)
            z = tl.load(sz + 1, mask=m2, other=0.0).to(tl.float32)
            return tl.sum(s * (d - 8.0 * xs[None, :]) + z * xs[None, :], axis=1)

    @triton.jit
    def _gate_up_gemv_grouped(x_ptr, arena_ptr, slot_ptr, h_ptr, SLOT_OFF, table_ptr, log_ptr, K: tl.constexpr,
                              H: tl.constexpr, I: tl.constexpr, REC: tl.constexpr, TABLE: tl.constexpr,
                              LOG: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, FMT: tl.constexpr,
                              G: tl.constexpr, BLOCK_I: tl.constexpr, SPAN: tl.constexpr, LIMIT: tl.constexpr = 0.0):
        p = tl.program_id(0)
        rec = record_ptr(arena_ptr, slot_ptr, table_ptr, log_ptr, p, SLOT_OFF, REC, TABLE, LOG)
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        rmask = rows < I
        r64 = rows.to(tl.int64)
        x_row = x_ptr + (p // K) * H
        acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
        for gi in range(0, H // G, SPAN):
            acc_g += _group_dot(rec + GATE, r64, rmask, x_row, gi, I, H, FMT, G, BLOCK_I, SPAN)
            acc_u += _group_dot(rec + UP, r64, rmask, x_row, gi, I, H, FMT, G, BLOCK_I, SPAN)
        tl.store(h_ptr + p * I + rows, swiglu(acc_g, acc_u, h_ptr.dtype.element_ty, LIMIT), mask=rmask)

    @triton.jit
    def _down_gemv_grouped(h_ptr, arena_ptr, slot_ptr, w_ptr, y_ptr, SLOT_OFF, table_ptr, H: tl.constexpr,
                           I: tl.constexpr, REC: tl.constexpr, TABLE: tl.constexpr, DOWN: tl.constexpr,
                           FMT: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr, SPAN: tl.constexpr):
        p = tl.program_id(0)
        rec = record_ptr(arena_ptr, slot_ptr, table_ptr, slot_ptr, p, SLOT_OFF, REC, TABLE, False)
        rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        rmask = rows < H
        r64 = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for gi in range(0, I // G, SPAN):
            acc += _group_dot(rec + DOWN, r64, rmask, h_ptr + p * I, gi, H, I, FMT, G, BLOCK_H, SPAN)
        acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + p).to(tl.float32)
        tl.store(y_ptr + p * H + rows, acc * w, mask=rmask)

    @triton.jit
    def _gate_up_gemm(x_ptr, arena_ptr, block_slot_ptr, pair_ptr, h_ptr, K: tl.constexpr, H: tl.constexpr,
                      I: tl.constexpr, REC: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, FMT: tl.constexpr,
                      G: tl.constexpr, IEEE: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LIMIT: tl.constexpr = 0.0, TG: tl.constexpr = 0,
                      TU: tl.constexpr = 0, SG: tl.constexpr = 32, SU: tl.constexpr = 32):
        pm = tl.program_id(0)
        rec = arena_ptr + tl.load(block_slot_ptr + pm).to(tl.int64) * REC
        tg, tu, td = _record_types(rec, FMT)
        pairs = tl.load(pair_ptr + pm * BLOCK_M + tl.arange(0, BLOCK_M))     # -1: padding
        pmask = pairs >= 0
        toks = tl.where(pmask, pairs // K, 0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < I
        out_ty = h_ptr.dtype.element_ty
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < H
            xt = tl.load(x_ptr + toks[:, None] * H + ks[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
            if FMT == 6:
                g = _ggml_tile(rec + GATE, rows, rmask, k0, H, TG, SG, BLOCK_N, BLOCK_K).to(out_ty)
                u = _ggml_tile(rec + UP, rows, rmask, k0, H, TU, SU, BLOCK_N, BLOCK_K).to(out_ty)
            elif VEC:
                g = _weights_tile(rec + GATE, rows, rmask, k0, I, H, FMT, G, BLOCK_N, BLOCK_K).to(out_ty)
                u = _weights_tile(rec + UP, rows, rmask, k0, I, H, FMT, G, BLOCK_N, BLOCK_K).to(out_ty)
            else:
                m = rmask[:, None] & kmask[None, :]
                g = _weights(rec + GATE, rows, ks, m, I, H, FMT, G, tg).to(out_ty)
                u = _weights(rec + UP, rows, ks, m, I, H, FMT, G, tu).to(out_ty)
            if IEEE:
                acc_g += tl.dot(xt, tl.trans(g), input_precision="ieee")
                acc_u += tl.dot(xt, tl.trans(u), input_precision="ieee")
            else:
                acc_g += tl.dot(xt, tl.trans(g))
                acc_u += tl.dot(xt, tl.trans(u))
        hv = swiglu(acc_g, acc_u, out_ty, LIMIT)
        dst = h_ptr + pairs[:, None].to(tl.int64) * I + rows[None, :]
        tl.store(dst, hv, mask=pmask[:, None] & rmask[None, :])

    @triton.jit
    def _down_gemm(h_ptr, arena_ptr, block_slot_ptr, pair_ptr, w_ptr, y_ptr, H: tl.constexpr, I: tl.constexpr,
                   REC: tl.constexpr, DOWN: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, IEEE: tl.constexpr,
                   VEC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   TD: tl.constexpr = 0, SD: tl.constexpr = 32):
        pm = tl.program_id(0)
        rec = arena_ptr + tl.load(block_slot_ptr + pm).to(tl.int64) * REC
        tg, tu, td = _record_types(rec, FMT)
        pairs = tl.load(pair_ptr + pm * BLOCK_M + tl.arange(0, BLOCK_M))
        pmask = pairs >= 0
        prow = tl.where(pmask, pairs, 0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < H
        out_ty = h_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < I
            ht = tl.load(h_ptr + prow[:, None] * I + ks[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
            if FMT == 6:
                d = _ggml_tile(rec + DOWN, rows, rmask, k0, I, TD, SD, BLOCK_N, BLOCK_K).to(out_ty)
            elif VEC:
                d = _weights_tile(rec + DOWN, rows, rmask, k0, H, I, FMT, G, BLOCK_N, BLOCK_K).to(out_ty)
            else:
                d = _weights(rec + DOWN, rows, ks, rmask[:, None] & kmask[None, :], H, I, FMT, G, td).to(out_ty)
            if IEEE:
                acc += tl.dot(ht, tl.trans(d), input_precision="ieee")
            else:
                acc += tl.dot(ht, tl.trans(d))
        acc = acc.to(out_ty).to(tl.float32)
        w = tl.load(w_ptr + prow, mask=pmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + prow[:, None] * H + rows[None, :], acc * w[:, None], mask=pmask[:, None] & rmask[None, :])


def _params(layout: QuantLayout) -> dict:
    assert layout.order == "rows", "the Triton kernels read rows-order quantized records"
    reg = layout.regions
    return dict(GATE=reg["gate"][0], UP=reg["up"][0], FMT=MIXED_FMT if layout.mixed else FMT[layout.scheme])


def _group(inp: int, layout: QuantLayout) -> int:
    """The G the kernels take: the scheme's group; 1 (unused) for a ggml: record, whose blocks say their own."""
    return 1 if layout.mixed else group_size(inp, layout.scheme)


def _typed(layout: QuantLayout, types) -> list[tuple[int, int]] | None:
    """[(GGML code, sub-block width)] of gate, up, down where the launch can name the record's types as constexprs
    (GGUF blocks and `types` given: one layer's records all have the types its three tensors have), else None."""
    if types is None or layout.scheme in ("int8", "int4"):
        return None
    got = [ggml.ggml_type(t) for t in types]
    return [(g.code, SUB[g.name]) for g in got]


# The typed GEMVs' tiles (gate/up: block_i rows, up to up_chunk weights a step, q4_k_up_chunk where both are Q4_K by
# _q4_k_dot (pairs) — a whole 2048-wide row, as int4's best; down: block_h, down_chunk), and the typed grouped GEMM's (block_n, block_k, warps)
# by block_m: not timed on the H200 yet; chosen where ptxas (sm_90, Triton 3.6) spills no register at Qwen3-30B-A3B's
# experts (Q4_K gate/up, Q6_K or Q4_K down) — int4's GEMM_TILES spill hundreds of bytes with these tiles (two
# [block_n, block_k] weight tiles decoded a step). bench.gguf_gpu_kernels times them (and others) on the device.
TYPED_GEMV = dict(block_i=8, up_chunk=1024, q4_k_up_chunk=2048, up_warps=8, block_h=32, down_chunk=256, down_warps=4,
                  pairs=True)
TYPED_GEMM_TILES = {16: (64, 128, 8), 32: (128, 64, 8), 64: (64, 64, 8), 128: (64, 64, 8)}


def chunk(inp: int, most: int = 1024) -> int:
    """Weights per step of the typed GEMVs: the largest power of two up to `most` dividing `inp` (at least 32, every
    sub-block's multiple: the masks cover a row that is not whole chunks)."""
    n = 32
    while n * 2 <= most and inp % (n * 2) == 0:
        n *= 2
    return n


def span(groups: int, most: int = 64) -> int:
    """Groups per load in the int8/int4 decode GEMVs: the largest power of two up to `most` dividing `groups`."""
    n = 1
    while n * 2 <= most and groups % (n * 2) == 0:
        n *= 2
    return n


def quant_slot_moe(x: torch.Tensor, arena: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor,
                   layout: QuantLayout, *, block_i: int = 8, block_h: int = 32, slot_offset: int = 0,
                   table: torch.Tensor | None = None, log: torch.Tensor | None = None,
                   max_span: int = 64, warps: int = 2, limit: float | None = None, types=None,
                   typed: dict | None = None) -> torch.Tensor:
    """Decode: Σ_k w[t,k]·expert(slot_offset + slots[t,k])(x[t]) by the GEMV kernels. x [T,H]; arena
    [S, record_bytes] uint8; slots [T,K]; topk_weights [T,K]. Returns [T,H] in x.dtype. table / log: as
    engine.kernels.triton_moe.slot_moe's (byte offsets here: the arena is bytes). max_span / warps: the int8/int4
    GEMVs' groups per load (span) and warps a program. types: the (gate, up, down) GGML types of every record read
    (one layer's): GGUF records then go through the typed GEMVs (_ggml_sub: whole sub-blocks, the types compiled
    in; `typed` overrides TYPED_GEMV's tiles, and block_i / block_h do not apply), else a ggml: record's header
    names its types per element."""
    t, k = slots.shape
    hdim, idim = layout.hidden, layout.intermediate
    p = t * k
    # int4 on the H200 (bench/probes/decode_kernels.py, results/2026-12-03-h200-decode-kernels.json): 8 rows, up to
    # 64 groups a load (a whole gate/up row), 2 warps: a layer's 8 picks in 19.3 us (22.4 at 16 groups and 4 warps),
    # 4 streams' 32 picks in 51.3 (65.7).
    slot_flat = slots.reshape(-1).contiguous()
    h = torch.empty(p, idim, dtype=x.dtype, device=x.device)
    y = torch.empty(p, hdim, dtype=torch.float32, device=x.device)
    prm = _params(layout)
    rec = layout.record_bytes
    w_flat = topk_weights.reshape(-1).contiguous()
    tab, lg, use_table, use_log = table_args(table, log, slot_flat)
    where = dict(REC=rec, TABLE=use_table)
    if layout.scheme in ("int8", "int4"):
        # Group-wise codes: one scale per (row, group), the codes' dot product per group (_group_dot).
        gh, gi = group_size(hdim, layout.scheme), group_size(idim, layout.scheme)
        _gate_up_gemv_grouped[(p, triton.cdiv(idim, block_i))](
            x.contiguous(), arena, slot_flat, h, slot_offset, tab, lg, K=k, H=hdim, I=idim, LOG=use_log, **where,
            GATE=prm["GATE"], UP=prm["UP"], FMT=prm["FMT"], G=gh, BLOCK_I=block_i,
            SPAN=span(hdim // gh, max_span), LIMIT=limit_arg(limit), num_warps=warps)
        _down_gemv_grouped[(p, triton.cdiv(hdim, block_h))](
            h, arena, slot_flat, w_flat, y, slot_offset, tab, H=hdim, I=idim, **where,
            DOWN=layout.regions["down"][0], FMT=prm["FMT"], G=gi, BLOCK_H=block_h,
            SPAN=span(idim // gi, max_span), num_warps=warps)
        return sum_picks(y, t, k, x.dtype)
    if (tys := _typed(layout, types)) is not None:
        (tg, sg), (tu, su), (td, sd) = tys
        c = {**TYPED_GEMV, **(typed or {})}
        up_chunk = c["q4_k_up_chunk"] if c["pairs"] and tg == tu == ggml.ggml_type("q4_k").code else c["up_chunk"]
        _gate_up_gemv_ggml[(p, triton.cdiv(idim, c["block_i"]))](
            x.contiguous(), arena, slot_flat, h, slot_offset, tab, lg, K=k, H=hdim, I=idim, LOG=use_log, **where,
            GATE=prm["GATE"], UP=prm["UP"], TG=tg, TU=tu, SG=sg, SU=su, BLOCK_I=c["block_i"],
            CHUNK=chunk(hdim, up_chunk), LIMIT=limit_arg(limit), PAIRS=c["pairs"], num_warps=c["up_warps"])
        _down_gemv_ggml[(p, triton.cdiv(hdim, c["block_h"]))](
            h, arena, slot_flat, w_flat, y, slot_offset, tab, H=hdim, I=idim, **where,
            DOWN=layout.regions["down"][0], TD=td, SD=sd, BLOCK_H=c["block_h"], CHUNK=chunk(idim, c["down_chunk"]),
            PAIRS=c["pairs"], num_warps=c["down_warps"])
        return sum_picks(y, t, k, x.dtype)
    _gate_up_gemv[(p, triton.cdiv(idim, block_i))](
        x.contiguous(), arena, slot_flat, h, slot_offset, tab, lg, K=k, H=hdim, I=idim, LOG=use_log, **where,
        GATE=prm["GATE"], UP=prm["UP"], FMT=prm["FMT"], G=_group(hdim, layout), BLOCK_I=block_i,
        BLOCK_H=128, LIMIT=limit_arg(limit))
    _down_gemv[(p, triton.cdiv(hdim, block_h))](
        h, arena, slot_flat, w_flat, y, slot_offset, tab, H=hdim, I=idim, **where,
        DOWN=layout.regions["down"][0], FMT=prm["FMT"], G=_group(idim, layout), BLOCK_H=block_h,
        BLOCK_I=128)
    return sum_picks(y, t, k, x.dtype)


def _runs(slots_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by slot (stable) → (order, the slots in use, pairs a slot)."""
    order = torch.argsort(slots_flat, stable=True)
    uniq, counts = torch.unique_consecutive(slots_flat[order], return_counts=True)
    return order, uniq, counts


def _align_pairs(slots_flat: torch.Tensor, block_m: int, runs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by slot, each slot's run padded to block_m with -1 → (pair ids [B·block_m], slot per block [B])."""
    order, uniq, counts = runs if runs is not None else _runs(slots_flat)
    blocks = (counts + block_m - 1) // block_m
    pairs = torch.full((int(blocks.sum()) * block_m,), -1, dtype=torch.int32, device=slots_flat.device)
    starts = torch.cumsum(blocks, 0) - blocks
    run_start = torch.cumsum(counts, 0) - counts
    # position of each sorted pair: its slot's first block, plus its rank within the slot's run
    rank = torch.arange(order.numel(), device=order.device) - torch.repeat_interleave(run_start, counts)
    pos = torch.repeat_interleave(starts, counts) * block_m + rank
    pairs[pos] = order.to(torch.int32)
    return pairs, torch.repeat_interleave(uniq.to(torch.int32), blocks)


def block_m_for(pairs: int, slots_used: int, most: int = 64) -> int:
    """Rows of a grouped-GEMM tile: the pairs a slot has on average, as a power of two from 16 (tl.dot's least) up
    to `most`. Every tile dequantizes its BLOCK_N rows of the weights afresh, so the fewer tiles a slot's run
    takes the fewer times its weights are unpacked; past the run's length a tile only computes padding."""
    m = 16
    while m < most and m < pairs / max(slots_used, 1):
        m *= 2
    return m


# The grouped GEMM's tiles as measured on the H200 (bench/probes/prefill_kernels.py, results/2026-12-03-h200-prefill-
# kernels-1.json and -kernels.json; int4, top-8 of 128, one layer): 128 tokens (8 pairs a slot: 16-row tiles) in
# 0.79 ms with 64 x 128 weight tiles (7.75 with the weights unpacked element by element), 512 tokens (32-row tiles)
# in 1.06 with 128 x 64 (17.9), 2048 tokens (64-row tiles) in 1.79 with 64 x 128 (59.9); 128-row tiles gained
# nothing sure (1.71-2.38 by tile and warps). Keyed by block_m: (block_n, block_k, warps).
GEMM_DEFAULTS = dict(most_m=64, stages=3, vec=True)
GEMM_TILES = {16: (64, 128, 4), 32: (128, 64, 4), 64: (64, 128, 4), 128: (128, 128, 8)}


def quant_grouped_moe(x: torch.Tensor, arena: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor,
                      layout: QuantLayout, *, block_m: int | None = None, most_m: int | None = None,
                      block_n: int | None = None, block_k: int | None = None, warps: int | None = None,
                      stages: int | None = None, vec: bool | None = None, limit: float | None = None,
                      types=None) -> torch.Tensor:
    """Prefill: the same function as quant_slot_moe by a grouped GEMM over the pairs of each slot. block_m: the
    tile's rows (None: block_m_for the pairs a slot has, up to most_m); block_n / block_k: the weight tile (None:
    GEMM_TILES[block_m], as are warps); vec: int8/int4 weights by _weights_tile (block_k rounded up to a multiple of the scheme's
    group) rather than per element; types: as quant_slot_moe's (GGUF tiles by _ggml_tile, the types compiled in);
    the rest: GEMM_DEFAULTS."""
    o = {k: v for k, v in dict(most_m=most_m, block_n=block_n, block_k=block_k, warps=warps, stages=stages,
                               vec=vec).items() if v is not None}
    o = {**GEMM_DEFAULTS, **o}
    t, k = slots.shape
    hdim, idim = layout.hidden, layout.intermediate
    p = t * k
    flat = slots.reshape(-1).to(torch.int64)
    runs = _runs(flat)
    bm = block_m or block_m_for(p, runs[1].numel(), o["most_m"])
    tys = _typed(layout, types)
    tiles = GEMM_TILES if tys is None else TYPED_GEMM_TILES
    tile_n, tile_k, tile_warps = tiles.get(bm, tiles[32])
    pairs, block_slot = _align_pairs(flat, bm, runs)
    nb = block_slot.numel()
    h = torch.zeros(p, idim, dtype=x.dtype, device=x.device)
    y = torch.empty(p, hdim, dtype=torch.float32, device=x.device)
    prm = _params(layout)
    ieee = x.dtype == torch.float32            # no TF32 for fp32 models: keep the reference's precision
    rec = layout.record_bytes
    gh, gi = _group(hdim, layout), _group(idim, layout)
    vec = o["vec"] and layout.scheme in ("int8", "int4")
    bn, bk = o.get("block_n", tile_n), o.get("block_k", tile_k)
    bk_up = -(-bk // gh) * gh if vec else bk         # a tile covers whole groups
    bk_down = -(-bk // gi) * gi if vec else bk
    launch = dict(IEEE=ieee, VEC=vec, BLOCK_M=bm, BLOCK_N=bn, num_warps=o.get("warps", tile_warps),
                  num_stages=o["stages"])
    fmt, up_types, down_types = prm["FMT"], {}, {}
    if tys is not None:                   # block_k: a power of two from 32, whole sub-blocks
        fmt = TYPED_FMT
        (tg, sg), (tu, su), (td, sd) = tys
        up_types, down_types = dict(TG=tg, TU=tu, SG=sg, SU=su), dict(TD=td, SD=sd)
    _gate_up_gemm[(nb, triton.cdiv(idim, bn))](
        x.contiguous(), arena, block_slot, pairs, h, K=k, H=hdim, I=idim, REC=rec, GATE=prm["GATE"],
        UP=prm["UP"], FMT=fmt, G=gh, BLOCK_K=bk_up, LIMIT=limit_arg(limit), **up_types, **launch)
    _down_gemm[(nb, triton.cdiv(hdim, bn))](
        h, arena, block_slot, pairs, topk_weights.reshape(-1).contiguous(), y, H=hdim, I=idim, REC=rec,
        DOWN=layout.regions["down"][0], FMT=fmt, G=gi, BLOCK_K=bk_down, **down_types, **launch)
    return y.view(t, k, hdim).sum(dim=1).to(x.dtype)


def quant_moe_reference(x, arena, slots, topk_weights, layout: QuantLayout, limit: float | None = None) -> torch.Tensor:
    """The oracle: each pick's record dequantized by engine.quant.records (plain torch), then the plain
    per-expert loop (engine.experts.moe_reference) in x.dtype."""
    return moe_reference(x, slots.long(), topk_weights, lambda s: layout.dequantize(arena[s]), limit)


def quant_moe_from_slots(x, arena, slots, topk_weights, layout: QuantLayout, *, slot_offset: int = 0,
                         table: torch.Tensor | None = None, log: torch.Tensor | None = None,
                         limit: float | None = None, types=None, gemv: dict | None = None) -> torch.Tensor:
    """The providers' hook: GEMV kernels for few pairs (decode), the grouped GEMM for many (prefill);
    the reference where Triton cannot run. The slots read are slot_offset + slots (or a record table's).
    limit: the experts' swiglu limit, in every one of them (None: none). types: the records' (gate, up, down)
    GGML types where the caller knows them (one layer's: the provider's record_types), for the typed kernels.
    gemv: quant_slot_moe's int8/int4 tiles (max_span, warps, block_i, block_h) where the caller's reads differ
    from HBM's (zero-copy decode reads most records over PCIe)."""
    if available(x.device) and slots.numel() <= GEMV_MAX_PAIRS:
        return quant_slot_moe(x, arena, slots, topk_weights, layout, slot_offset=slot_offset, table=table, log=log,
                              limit=limit, types=types, **(gemv or {}))
    if slot_offset:
        slots = slots + slot_offset
    if not available(x.device):
        return quant_moe_reference(x, arena, slots, topk_weights, layout, limit)
    return quant_grouped_moe(x, arena, slots, topk_weights, layout, limit=limit, types=types)

"""y = x·Wᵀ on the GPU for a GGUF dense matrix kept in its own blocks (attention q|k|v and o, the output head):
W [out, in] of one GGML type, read a sub-block at a time by quant_triton's _ggml_sub (the typed expert kernels'
decoding: the type a constexpr, codes in contiguous loads, one scale and offset a sub-block), so a Q4_K matrix
moves its 4.5 bits a weight instead of bf16's 16. Accumulation fp32, y in x.dtype.

  few rows (decode, <= GEMV_ROWS)  one program per (row of x, BLOCK_R outputs): Σ q·x per sub-block, scaled once
  many rows (prefill)              tl.dot over BLOCK_M rows of x by BLOCK_N outputs, the weights dequantized into
                                   registers a tile at a time and rounded to x.dtype (as a float weight in that
                                   dtype would be)

Plain Triton, as quant_triton: sm_80/sm_90 alike, and Triton's interpreter on CPU tensors in the tests.
"""
from __future__ import annotations

import torch

from engine.kernels import import_triton
from engine.kernels.quant_triton import SUB, available, chunk
from engine.quant import ggml

triton, tl = import_triton()

GEMV_ROWS = 8          # rows of x up to which the GEMV runs: decode's streams (one row each)

if triton is not None:
    from engine.kernels.quant_triton import _ggml_dot, _ggml_tile      # jitted: they exist only with Triton

    @triton.jit
    def _gemv(x_ptr, w_ptr, y_ptr, OUT: tl.constexpr, IN: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
              BLOCK_R: tl.constexpr, CHUNK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < OUT
        r64 = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, IN, CHUNK):
            acc += _ggml_dot(w_ptr, r64, rmask, x_ptr + t * IN, k0, IN, T, S, BLOCK_R, CHUNK)
        tl.store(y_ptr + t * OUT + rows, acc.to(y_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _gemm(x_ptr, w_ptr, y_ptr, N, OUT: tl.constexpr, IN: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
              IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        xr = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        xmask = xr < N
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < OUT
        out_ty = y_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + xr[:, None].to(tl.int64) * IN + ks[None, :],
                         mask=xmask[:, None] & (ks < IN)[None, :], other=0.0)
            w = _ggml_tile(w_ptr, rows, rmask, k0, IN, T, S, BLOCK_N, BLOCK_K).to(out_ty)
            if IEEE:
                acc += tl.dot(xt, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(w))
        tl.store(y_ptr + xr[:, None].to(tl.int64) * OUT + rows[None, :], acc.to(out_ty),
                 mask=xmask[:, None] & rmask[None, :])


# (block_m, block_n, block_k, warps) by rows of x: not measured on the H200 yet (the experts' GEMM_TILES' shapes).
GEMM_TILES = {64: (64, 128, 64, 4), 128: (128, 128, 64, 8)}


def ggml_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: str | int, out: int, *, block_r: int = 8,
                most_chunk: int = 1024, warps: int = 4, tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [N, in] (contiguous) · Wᵀ, W the [out, in] matrix whose blocks are `blocks` (uint8, out·row bytes, on x's
    device) of GGML type ggml_type → [N, out] in x.dtype. block_r / most_chunk / warps: the GEMV's; tile: the GEMM's
    (block_m, block_n, block_k, warps), None: GEMM_TILES by N."""
    g = ggml.ggml_type(ggml_type)
    n, inp = x.shape
    y = torch.empty(n, out, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    t, s = g.code, SUB[g.name]
    if n <= GEMV_ROWS:
        _gemv[(n, triton.cdiv(out, block_r))](x, blocks, y, OUT=out, IN=inp, T=t, S=s, BLOCK_R=block_r,
                                              CHUNK=chunk(inp, most_chunk), num_warps=warps)
        return y
    bm, bn, bk, w = tile or GEMM_TILES[64 if n <= 256 else 128]
    _gemm[(triton.cdiv(n, bm), triton.cdiv(out, bn))](x, blocks, y, n, OUT=out, IN=inp, T=t, S=s,
                                                      IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
                                                      BLOCK_K=bk, num_warps=w, num_stages=3)
    return y


__all__ = ["GEMV_ROWS", "GEMM_TILES", "available", "ggml_linear"]

"""CPU kernels for the experts: the same arithmetic as engine.experts.expert_ffn, laid out so torch's intra-op
threads share a decode step and every GEMV runs sequentially (the same bits on one thread or several).

The compute-thread policy lives here too: how many intra-op threads the engine's CPU decode runs on.
"""
from __future__ import annotations

import os

import torch

from engine.experts.reference import swiglu


def default_threads() -> int:
    """torch intra-op threads for the engine's CPU decode: 2 where the process may use 2 CPUs or more.
    The work split between them is a pair of experts (or two column halves of lm_head) in one batched
    matmul; bench/smollm2_demo_speed.py measured 2 > 1 on this 2-core machine, more were not measured."""
    return min(2, len(os.sched_getaffinity(0)))


def set_compute_threads(n: int | None = None) -> int:
    """torch's intra-op threads for the engine (None: default_threads()); returns the number set."""
    n = default_threads() if n is None else n
    if n < 1:
        raise ValueError(f"threads is {n}; it must be at least 1")
    torch.set_num_threads(n)
    return n


def _as_batch(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """Two equally shaped, equally strided views of ONE storage as a [2, ...] view (no copy), lower address
    first; (view, swapped). None when they cannot be (different storages or dtypes)."""
    if (a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype or a.device != b.device
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()):
        return None
    swapped = b.storage_offset() < a.storage_offset()
    lo, hi = (b, a) if swapped else (a, b)
    d = hi.storage_offset() - lo.storage_offset()
    if d == 0:
        return None
    return lo.as_strided((2, *lo.shape), (d, *lo.stride()), lo.storage_offset()), swapped


def _gate_up_matrix(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """gate and up of one record as ONE matrix that x multiplies in one matmul, and whether it is stored
    transposed: rows order [2I, H] (up right below gate), cols order [H, 2I] (up right beside gate).
    None when the views do not lie that way."""
    inter, hidden = gate.shape
    size = gate.element_size()
    if gate.stride() == (hidden, 1) and up.data_ptr() == gate.data_ptr() + gate.numel() * size:
        return gate.as_strided((2 * inter, hidden), gate.stride()), False
    if gate.stride() == (1, 2 * inter) and up.stride() == gate.stride() and up.data_ptr() == gate.data_ptr() + inter * size:
        return gate.as_strided((hidden, 2 * inter), (2 * inter, 1)), True
    return None


def pair_ffn(xa: torch.Tensor, xb: torch.Tensor, va, vb,
             limit: float | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """expert_ffn for two experts at once — (expert_ffn(xa, *va), expert_ffn(xb, *vb)) — as batched matmuls
    over the records where they lie (gate|up read as one matrix), so torch's intra-op threads take one
    expert each, each GEMV running sequentially (a lone one-token GEMV runs on one thread here, and on
    some CPUs is split by the BLAS in another summation order: see single_ffn). Every element is the
    dot product a sequential GEMV computes (tests/engine/test_speed_paths.py checks bitwise), in either
    record order.

    None (compute them one by one) unless the records are views of one storage in x's dtype and rows of
    `hidden` and `intermediate` elements keep 64-byte alignment: the BLAS kernel's path, hence its
    summation order, depends on where a vector starts, and the batch's second vectors start a row in."""
    (ga, ua, da), (gb, ub, db) = va, vb
    inter, hidden = ga.shape
    size = ga.element_size()
    if xa.shape != xb.shape or ga.dtype != xa.dtype or (hidden * size) % 64 or (inter * size) % 64:
        return None
    mats = _gate_up_matrix(ga, ua), _gate_up_matrix(gb, ub)
    if None in mats or mats[0][1] != mats[1][1]:
        return None
    cols = mats[0][1]
    # The batch's matrices as the GEMM's right operand, [2, K, N] (a transposed view in the rows order).
    gate_up = _as_batch(mats[0][0], mats[1][0])
    down = _as_batch(da.t(), db.t()) if cols else _as_batch(da, db)
    if gate_up is None or down is None or gate_up[1] != down[1]:
        return None
    swapped = down[1]
    rhs_gu, rhs_d = (gate_up[0], down[0]) if cols else (gate_up[0].transpose(1, 2), down[0].transpose(1, 2))
    x = torch.stack((xb, xa) if swapped else (xa, xb))
    gu = torch.bmm(x, rhs_gu)                                                    # [2, M, 2I]
    # silu(gate) * up per expert on contiguous [M, I] tensors: the elementwise loops see what expert_ffn's do.
    h = torch.stack([swiglu(gu[j, :, :inter].contiguous(), gu[j, :, inter:].contiguous(), limit) for j in range(2)])
    y = torch.bmm(h, rhs_d)                                                      # [2, M, H]
    return (y[1], y[0]) if swapped else (y[0], y[1])


def single_ffn(x: torch.Tensor, views, limit: float | None = None) -> torch.Tensor | None:
    """expert_ffn for one expert and one token, as two batched GEMVs of two halves each (gate and up; the
    two halves of down's outputs), so both intra-op threads work and every GEMV runs sequentially inside
    the batch. A lone GEMV may instead be split by the BLAS itself across threads, summing in another
    order on some CPUs (MKL on Intel Xeons does, tests/engine/test_speed_paths.py); a batch never is, so
    a one-token expert gives the same bits alone, in a pair (pair_ffn) or on any number of threads.
    None unless the record lies as its order says and every half starts 64-byte aligned."""
    gate, up, down = views
    inter, hidden = gate.shape
    size = gate.element_size()
    mat = _gate_up_matrix(gate, up)
    if mat is None or gate.dtype != x.dtype or x.shape[0] != 1 or (inter * size) % 64 or hidden % 2 \
            or (hidden // 2 * size) % 64:
        return None
    m, cols = mat
    x2 = x.reshape(1, 1, hidden).expand(2, 1, hidden)
    if cols:    # m = [gate^T | up^T] as [H, 2I]; down^T [I, H] split by output columns
        gu = torch.bmm(x2, m.view(hidden, 2, inter).transpose(0, 1))
        down_halves = down.t().view(inter, 2, hidden // 2).transpose(0, 1)
    else:       # m = [gate; up] as [2I, H]; down [H, I] split by output rows
        gu = torch.bmm(x2, m.view(2, inter, hidden).transpose(1, 2))
        down_halves = down.view(2, hidden // 2, inter).transpose(1, 2)
    h = swiglu(gu[0].contiguous(), gu[1].contiguous(), limit)                     # [1, I], as expert_ffn's
    return torch.bmm(h.reshape(1, 1, inter).expand(2, 1, inter), down_halves).reshape(1, hidden)

"""The Triton pieces every slot-indexed expert kernel shares (engine.kernels.triton_moe's float records and
engine.kernels.quant_triton's quantized ones): where a pick's record lies (record_ptr, table_args), the SwiGLU
epilogue (swiglu), the sum over a token's picks (sum_picks), and when the GEMV kernels run at all."""
from __future__ import annotations

import os

import torch

from engine.kernels import import_triton

# Triton ships with CUDA builds of torch; CPU-only installs use the reference path (and do not import triton at all).
triton, tl = import_triton()

# Below this many pairs the GEMV kernels win; above, per-expert GEMMs do (measured on the H200 bench).
GEMV_MAX_PAIRS = 64


def triton_available(device: torch.device) -> bool:
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def swiglu(acc_g, acc_u, ty: tl.constexpr, LIMIT: tl.constexpr = 0.0):
        """silu(g)·u from fp32 gate/up sums, each rounded to the model dtype where torch's F.linear and silu round
        (every expert kernel's epilogue: these GEMVs and the quantized kernels in engine.kernels.quant_triton).
        LIMIT > 0 (glm5_next's swiglu_limit, a compile-time constant): g clamped from above and u both ways, each
        rounded again as torch's clamp of a model-dtype tensor is (engine.experts.reference.swiglu); 0.0 compiles
        the plain epilogue, unchanged."""
        g = acc_g.to(ty).to(tl.float32)
        u = acc_u.to(ty).to(tl.float32)
        if LIMIT > 0:
            g = tl.minimum(g, LIMIT).to(ty).to(tl.float32)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT).to(ty).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(ty).to(tl.float32)
        return (s * u).to(ty)

    @triton.jit
    def record_ptr(arena_ptr, slot_ptr, table_ptr, log_ptr, p, SLOT_OFF, REC: tl.constexpr, TABLE: tl.constexpr,
                   LOG: tl.constexpr):
        """Pair p's record: slot SLOT_OFF + id[p] of the arena (REC elements a slot), or with TABLE the arena-relative
        element offset table[SLOT_OFF + id[p]] (anywhere the GPU can address: a slot, or a page-locked host record).
        LOG: id[p] also goes to log[p], written by the first row block's program."""
        sid = tl.load(slot_ptr + p).to(tl.int64)
        if LOG:
            tl.store(log_ptr + p, sid.to(tl.int32), mask=tl.program_id(1) == 0)
        if TABLE:
            return arena_ptr + tl.load(table_ptr + SLOT_OFF + sid)
        return arena_ptr + (sid + SLOT_OFF) * REC

    @triton.jit
    def _sum_picks_kernel(y_ptr, out_ptr, K: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr):
        """out[t] = Σ_k y[t·K + k] in pick order (fp32), rounded once to the model dtype."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            acc += tl.load(y_ptr + (t * K + k) * H + cols, mask=m, other=0.0)
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def limit_arg(limit: float | None) -> float:
    """A swiglu limit as the kernels' LIMIT constexpr: 0.0 for none (None or +inf), the plain epilogue."""
    return float(limit) if limit and limit != float("inf") else 0.0


def sum_picks(y: torch.Tensor, t: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T·K, H] fp32 weighted expert outputs → [T, H] in `dtype`: `y.view(t, k, h).sum(1).to(dtype)` in one
    launch instead of two (a decode step does this once per MoE layer)."""
    hdim = y.shape[-1]
    out = torch.empty(t, hdim, dtype=dtype, device=y.device)
    _sum_picks_kernel[(t, triton.cdiv(hdim, 1024))](y, out, K=k, H=hdim, BLOCK=1024, num_warps=4)
    return out


def table_args(table: torch.Tensor | None, log: torch.Tensor | None, slots: torch.Tensor):
    """The kernels' (table, log) pointers and flags; unused pointers are the slots (never read)."""
    return (table if table is not None else slots, log if log is not None else slots,
            table is not None, log is not None)

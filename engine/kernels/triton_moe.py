"""Expert FFNs computed straight from cache slots, no gather.

Decode has few (token, expert) pairs: each pair is a GEMV against one expert's record. These
Triton kernels read each needed record exactly once, wherever its slot is in the arena
(slot-indexed, so the same kernel serves GPU-resident experts and an offload cache, and is
capturable in a CUDA graph: no host reads). Prefill has many tokens per expert, so it loops
over experts with dense GEMMs (moe_reference), which tensor cores do well.

  pairs p = t*K + k:  h[p]  = silu(gate_s x_t) * (up_s x_t)          (kernel 1)
                      y[p]  = w[p] * (down_s h[p])                    (kernel 2)
                      out_t = Σ_k y[t*K + k]
Accumulation is fp32; g and u are rounded to the model dtype before the SiLU as torch's bf16
F.linear does, so results agree with the reference to bf16 rounding.

Where a record lies (engine.kernels.triton_common.record_ptr, shared with engine.kernels.quant_triton): slot_offset + the pick's id in the
arena, or with a `table` the element offset table[slot_offset + id] from the arena's start, which may point
into page-locked host memory the GPU reads in place over PCIe (engine.tiers.zero_copy). With a `log`, the kernels
also write each pick's id there, so the host learns a graph-replayed step's routing without reading it per layer.
"""
from __future__ import annotations

import torch

from engine.experts.layout import ExpertLayout
from engine.experts.reference import moe_reference
from engine.kernels import import_triton
from engine.kernels.quant_triton import quant_moe_from_slots
from engine.kernels.triton_common import GEMV_MAX_PAIRS, limit_arg, sum_picks, table_args, triton_available

# Triton ships with CUDA builds of torch; CPU-only installs use the reference path (and do not import triton at all).
triton, tl = import_triton()

if triton is not None:
    from engine.kernels.triton_common import record_ptr, swiglu      # jitted: they exist only with Triton

    @triton.jit
    def _read_kernel(arena_ptr, off, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(arena_ptr + off + i, mask=i < N), mask=i < N)

    @triton.jit
    def _gate_up_kernel(x_ptr, arena_ptr, slot_ptr, h_ptr, SLOT_OFF, table_ptr, log_ptr, K: tl.constexpr,
                        H: tl.constexpr, I: tl.constexpr, REC: tl.constexpr, TABLE: tl.constexpr, LOG: tl.constexpr,
                        BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, LIMIT: tl.constexpr = 0.0):
        p = tl.program_id(0)
        bi = tl.program_id(1)
        t = p // K
        gate = record_ptr(arena_ptr, slot_ptr, table_ptr, log_ptr, p, SLOT_OFF, REC, TABLE, LOG)
        up = gate + I * H
        rows = bi * BLOCK_I + tl.arange(0, BLOCK_I)
        rmask = rows < I
        acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            cmask = cols < H
            xv = tl.load(x_ptr + t * H + cols, mask=cmask, other=0.0).to(tl.float32)
            m = rmask[:, None] & cmask[None, :]
            off = rows[:, None] * H + cols[None, :]
            g = tl.load(gate + off, mask=m, other=0.0).to(tl.float32)
            acc_g += tl.sum(g * xv[None, :], axis=1)
            u = tl.load(up + off, mask=m, other=0.0).to(tl.float32)
            acc_u += tl.sum(u * xv[None, :], axis=1)
        tl.store(h_ptr + p * I + rows, swiglu(acc_g, acc_u, h_ptr.dtype.element_ty, LIMIT), mask=rmask)

    @triton.jit
    def _down_kernel(h_ptr, arena_ptr, slot_ptr, w_ptr, y_ptr, SLOT_OFF, table_ptr, H: tl.constexpr,
                     I: tl.constexpr, REC: tl.constexpr, TABLE: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_I: tl.constexpr):
        p = tl.program_id(0)
        bh = tl.program_id(1)
        down = record_ptr(arena_ptr, slot_ptr, table_ptr, slot_ptr, p, SLOT_OFF, REC, TABLE, False) + 2 * I * H
        rows = bh * BLOCK_H + tl.arange(0, BLOCK_H)
        rmask = rows < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            cmask = cols < I
            hv = tl.load(h_ptr + p * I + cols, mask=cmask, other=0.0).to(tl.float32)
            d = tl.load(down + rows[:, None] * I + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            acc += tl.sum(d.to(tl.float32) * hv[None, :], axis=1)
        # Round the expert output to the model dtype before weighting, as the reference does.
        acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + p).to(tl.float32)
        tl.store(y_ptr + p * H + rows, acc * w, mask=rmask)



def read_record(arena: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """n elements at element `offset` from the arena's start, read by a kernel (the offset a record table holds:
    it may point outside the arena, into page-locked host memory) → a flat tensor on the arena's device."""
    out = torch.empty(n, dtype=arena.dtype, device=arena.device)
    _read_kernel[(triton.cdiv(n, 1024),)](arena, offset, out, N=n, BLOCK=1024)
    return out


def slot_moe(x: torch.Tensor, arena: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor,
             layout: ExpertLayout, *, slot_offset: int = 0, table: torch.Tensor | None = None,
             log: torch.Tensor | None = None, block_i: int = 4, block_h: int = 16,
             gate_up_cols: int | None = None, down_cols: int = 256, warps: int = 4,
             limit: float | None = None) -> torch.Tensor:
    """Σ_k w[t,k]·expert(slot_offset + slots[t,k])(x[t]) with Triton GEMV kernels. x [T,H]; arena
    [S, record_elems] in layout.dtype; slots [T,K] int32/int64 (e.g. a router's expert ids, offset to a layer's
    first slot inside the kernels: no add launched); topk_weights [T,K]. Returns [T,H] x.dtype.
    table: int64 element offsets of records from the arena's start, read at slot_offset + slots[t,k] instead
    (record_ptr); log: int32 [≥ T·K], receives slots flattened (the routing of this step). limit: the experts'
    swiglu limit (engine.experts.reference.swiglu; None: none)."""
    t, k = slots.shape
    hdim, idim = layout.hidden, layout.intermediate
    p = t * k
    # Tiles from bench/probes/decode_kernels.py on the H200 (results/2026-12-01-h200-decode-kernels.json): a
    # decode GEMV is bound by load latency, so few rows per program and whole input rows per load (gate/up:
    # 4 rows x 2048; down: 16 rows x 256) — one Qwen3-30B-A3B layer's 8 picks in 26 us instead of 58.
    gate_up_cols = gate_up_cols or min(triton.next_power_of_2(hdim), 2048)
    xs = x.contiguous()
    slot_flat = slots.reshape(-1).contiguous()
    h = torch.empty(p, idim, dtype=x.dtype, device=x.device)
    y = torch.empty(p, hdim, dtype=torch.float32, device=x.device)
    tab, lg, use_table, use_log = table_args(table, log, slot_flat)
    _gate_up_kernel[(p, triton.cdiv(idim, block_i))](
        xs, arena, slot_flat, h, slot_offset, tab, lg, K=k, H=hdim, I=idim, REC=layout.record_elems,
        TABLE=use_table, LOG=use_log, BLOCK_I=block_i, BLOCK_H=gate_up_cols, LIMIT=limit_arg(limit), num_warps=warps)
    _down_kernel[(p, triton.cdiv(hdim, block_h))](
        h, arena, slot_flat, topk_weights.reshape(-1).contiguous(), y, slot_offset, tab, H=hdim, I=idim,
        REC=layout.record_elems, TABLE=use_table, BLOCK_H=block_h, BLOCK_I=down_cols, num_warps=warps)
    return sum_picks(y, t, k, x.dtype)


def slot_moe_reference(x, arena, slots, topk_weights, layout: ExpertLayout, expert_ids=None,
                       limit: float | None = None) -> torch.Tensor:
    """The same function as slot_moe via moe_reference (per-expert GEMMs): the prefill path and the oracle.
    Given expert_ids, experts are visited in expert order whatever their slots, so the accumulation
    order (hence every bf16 rounding) is the same in any cache state."""
    if expert_ids is None:
        return moe_reference(x, slots.long(), topk_weights, lambda s: layout.views(arena[s]), limit)
    slot_of = dict(zip(expert_ids.reshape(-1).tolist(), slots.reshape(-1).tolist()))
    return moe_reference(x, expert_ids, topk_weights, lambda e: layout.views(arena[slot_of[e]]), limit)


def moe_from_slots(x, arena, slots, topk_weights, layout: ExpertLayout, expert_ids=None, *,
                   slot_offset: int = 0, table: torch.Tensor | None = None,
                   log: torch.Tensor | None = None, limit: float | None = None, types=None,
                   gemv: dict | None = None) -> torch.Tensor:
    """Pick the kernel for the shape: GEMV kernels for few pairs (decode), GEMMs for many (prefill).
    Quantized records go to their own kernels (engine.kernels.quant_triton), picked the same way. The slots
    read are slot_offset + slots (the GEMV kernels add it themselves). table / log (slot_moe's): only the GEMV
    kernels read a record table, so a caller giving one must keep to their shapes. limit: the experts' swiglu
    limit (ExpertProvider.swiglu_limit), carried into every kernel; None: none. types: the records' (gate, up,
    down) GGML types (one layer's, GGUF records: the quantized kernels compile them in); None: unknown. gemv: the
    quantized GEMVs' tiles (engine.kernels.quant_triton.quant_moe_from_slots)."""
    if table is not None or log is not None:
        assert slots.numel() <= GEMV_MAX_PAIRS and triton_available(x.device), \
            "a record table is read by the GEMV kernels only: at most GEMV_MAX_PAIRS picks, where Triton runs"
    if layout.quantized:
        return quant_moe_from_slots(x, arena, slots, topk_weights, layout.quantized, slot_offset=slot_offset,
                                    table=table, log=log, limit=limit, types=types, gemv=gemv)
    if slots.numel() <= GEMV_MAX_PAIRS and triton_available(x.device):
        return slot_moe(x, arena, slots, topk_weights, layout, slot_offset=slot_offset, table=table, log=log,
                        limit=limit)
    if slot_offset:
        slots = slots + slot_offset
    return slot_moe_reference(x, arena, slots, topk_weights, layout, expert_ids, limit)

"""The CPU expert FFN on quantized records (engine.quant.records).

4-bit records in the cols order hold torch's own int4 operand, so gate|up is ONE
torch.ops.aten._weight_int4pack_mm_for_cpu call and down another: the fastest of the CPU paths measured
(bench/quant_cpu_kernels.py → bench/results/quant_cpu_kernels.json: torch's int4 kernel with bf16
activations against a dequantize-per-call fp32 GEMV, torch's float32-activation int4 path and its int8
kernel). That kernel takes bf16 activations and returns bf16, so x, h and y are rounded to bf16 at the
kernel's edges (llama.cpp rounds activations further, to 8 bits, for its Q4 dot products); accumulation is
fp32. Records of per-matrix GGML types (ggml: layouts) go to the native per-type kernels (ggml_ffn here).
Every other record (8-bit schemes, rows order) is dequantized per call and computed as expert_ffn
does: correct everywhere, and the baseline the measurement compares against. One float32 token (a decode step)
goes to engine.kernels.native instead where it is built: the same function, faster at one row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.experts.reference import swiglu
from engine.kernels import native
from engine.quant import ggml
from engine.quant.records import QuantLayout, group_size, int4pack_operands, matrix_bytes


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    """x [M, in] · Wᵀ for torch's int4pack operand W (packed, sz): its kernel's function (x and the result
    rounded to bf16, fp32 accumulation). One float32 row goes to the engine's native GEMV where it is built
    (engine.kernels.native: the same function, faster at one row) and comes back float32; else torch's
    kernel, bf16."""
    if x.shape[0] == 1 and x.dtype == torch.float32 and x.shape[1] <= native.MAX_K and native.allowed() \
            and native.int4_ok():
        return native.int4pack_gemv(x.reshape(-1).contiguous(), packed, sz, group).view(1, -1)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed, group, sz)


def int4_linear(layout: QuantLayout, rec: torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor:
    """x [M, in] → x·Wᵀ [M, out] (bf16 values), W the cols record's int4pack matrix `name` (gate_up or down)."""
    _, _, out, inp = layout.regions[name]
    g = group_size(inp, layout.scheme)
    packed, sz = int4pack_operands(layout.region(rec, name), out, inp, g)
    return int4_mm(x, packed, g, sz)


def native_ffn_group(layout: QuantLayout) -> int | None:
    """The group size where one float32 token's FFN on this layout's records may be the native int4_ffn (the
    same function as torch's int4 kernel; one group size for both matrices, widths it takes), else None."""
    if not layout.cpu_int4 or max(layout.hidden, layout.intermediate) > native.MAX_K or not native.int4_ok():
        return None
    g = group_size(layout.hidden, layout.scheme)
    return g if g == group_size(layout.intermediate, layout.scheme) else None


def quant_ffn(layout: QuantLayout, rec: torch.Tensor, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """down(silu(gate x) * up x) for one quantized record; x [M, H] → [M, H] in x.dtype. limit: gate/up clamped
    there first (engine.experts.reference.swiglu; None: none)."""
    if layout.cpu_int4 and rec.device.type == "cpu":
        g = group_size(layout.hidden, layout.scheme)
        if x.shape[0] == 1 and x.dtype == torch.float32 and native.allowed() and native_ffn_group(layout):
            # one token: the whole FFN in one native call (the same function as below)
            return native.int4_ffn(x.reshape(-1).contiguous(), rec, layout.regions, g, limit).view(1, -1)
        i = layout.intermediate
        gu = int4_linear(layout, rec, "gate_up", x).float()
        h = swiglu(gu[:, :i], gu[:, i:], limit)
        return int4_linear(layout, rec, "down", h).to(x.dtype)
    if layout.mixed and rec.device.type == "cpu":
        y = ggml_ffn(layout, rec, x, limit)
        if y is not None:
            return y
    gate, up, down = (m.to(device=x.device, dtype=x.dtype) for m in layout.dequantize(rec))
    return F.linear(swiglu(F.linear(x, gate), F.linear(x, up), limit), down)


def ggml_ffn(layout: QuantLayout, rec: torch.Tensor, x: torch.Tensor, limit: float | None = None) -> torch.Tensor | None:
    """A ggml: record (each matrix in its own GGML type, named by the record's header) through the native
    per-type kernels, in fp32: one token in one ggml_ffn call, more as three ggml_matmul calls. None where the
    kernels are not built or lack one of the record's types."""
    types = layout.record_types(rec)
    codes = tuple(ggml.ggml_type(t).code for t in types)
    if not (native.allowed() and all(native.ggml_supported(c) for c in codes)):
        return None
    rec = rec.reshape(-1).view(torch.uint8)
    mats = [layout.region(rec, n)[:matrix_bytes(t, o, k)] for t, (n, (_, _, o, k)) in zip(types, layout.regions.items())]
    h, i = layout.hidden, layout.intermediate
    xf = x.float().contiguous()
    if x.shape[0] == 1:
        return native.ggml_ffn(xf.view(-1), *mats, codes, i, limit).view(1, h).to(x.dtype)
    g = native.ggml_matmul(codes[0], xf, mats[0], i)
    u = native.ggml_matmul(codes[1], xf, mats[1], i)
    return native.ggml_matmul(codes[2], swiglu(g, u, limit).contiguous(), mats[2], h).to(x.dtype)


def quant_ffn_reference(layout: QuantLayout, rec: torch.Tensor, x: torch.Tensor,
                        limit: float | None = None) -> torch.Tensor:
    """quant_ffn as a plain dequantize-then-matmul in fp32, rounded to bf16 where the int4 kernel's
    operands and results are (x, gate|up, h, y): the oracle tests/engine/test_quant.py holds it to."""
    gate, up, down = layout.dequantize(rec)
    if not layout.cpu_int4:
        return F.linear(swiglu(F.linear(x.float(), gate), F.linear(x.float(), up), limit), down).to(x.dtype)
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    xb = bf(x.float())
    g, u = bf(xb @ gate.t()), bf(xb @ up.t())
    return bf(bf(swiglu(g, u, limit)) @ down.t()).to(x.dtype)

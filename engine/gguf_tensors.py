"""A GGUF tensor as the engine holds it: the one place a GGUF model loader turns a tensor of any GGML type
(engine.quant.ggml) into what the engine computes with.

  weight(name, ggml_type, shape, raw, device=, dtype=, linear=)  a dense weight: on the CPU a linear weight keeps
        its blocks (a projection computed by that type's kernel); anything else is dequantized once, here, and the
        log says so where blocks were given up for want of a kernel
  projection(parts, device=, dtype=, rows=)                    several matrices of one input stacked along the output
        (q, k, v; gate, up) as one projection, each kept in its own type
  expert_layout(hidden, intermediate, types, order=)            the record layout a store of routed experts needs
        for each MoE layer's (gate, up, down) types
  expert_record(layout, gate, up, down)                         one expert's record from its three matrices, each
        (ggml_type, raw blocks) in its own type
"""
from __future__ import annotations

import logging
from typing import Iterable, Sequence

import numpy as np
import torch

from engine.experts.layout import ExpertLayout
from engine.dense_weights import Int4Projection, Projection, Q8Projection
from engine.quant import ggml
from engine.quant.records import GGUF_BLOCK, INT4PACK_N, QuantLayout, matrix_bytes, mixed_scheme

log = logging.getLogger("engine.quant")

FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _raw_tensor(raw, nbytes: int, name: str) -> torch.Tensor:
    """The tensor's bytes as a contiguous uint8 torch tensor (a copy: the reader's memory map may close)."""
    if isinstance(raw, torch.Tensor):
        t = raw.detach().reshape(-1).view(torch.uint8) if raw.dtype != torch.uint8 else raw.detach().reshape(-1)
        t = t.cpu().clone()
    else:
        t = torch.from_numpy(np.array(np.asarray(raw).reshape(-1).view(np.uint8), copy=True))
    if t.numel() != nbytes:
        raise ValueError(f"{name}: {t.numel()} bytes, its type and shape need {nbytes}")
    return t


class BlockProjection:
    """A dense weight [out, in] kept as a GGUF's own blocks of any GGML type, computed by the native CPU kernel
    (engine.kernels.native.ggml_matmul: each block dequantized once into fp32 and dotted with every row of x, as
    gguf's dequantization then a float32 matmul). CPU only."""

    def __init__(self, ggml_type: str | int, blocks: torch.Tensor, out_features: int, in_features: int):
        self.type = ggml.ggml_type(ggml_type)
        self.out_features, self.in_features = out_features, in_features
        self.blocks = blocks.reshape(out_features, -1).contiguous()
        self.cpu = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels import native        # the kernels build with g++ at first use: not at import
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = native.ggml_matmul(self.type.code, x2, self.blocks, self.out_features)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) dequantized, float32 [..., in]: an embedding's lookup."""
        flat = ids.reshape(-1).cpu()
        w = ggml.dequantize(self.type.name, self.blocks[flat], flat.numel(), self.in_features)
        return w.view(*ids.shape, self.in_features)

    def dequantized(self) -> torch.Tensor:
        return ggml.dequantize(self.type.name, self.blocks, self.out_features, self.in_features)


class DeviceBlockProjection:
    """A dense weight [out, in] kept as a GGUF's own blocks of one GGML type on the GPU (or any device Triton runs
    on), computed by engine.kernels.ggml_linear: the file's weights in float (each sub-block decoded as gguf
    dequantizes it), never a dequantized copy — a Q4_K matrix reads its 4.5 bits a weight a token, not bf16's 16."""

    def __init__(self, ggml_type: str | int, blocks: torch.Tensor, out_features: int, in_features: int):
        self.type = ggml.ggml_type(ggml_type)
        self.out_features, self.in_features = out_features, in_features
        self.blocks = blocks.reshape(-1).contiguous()
        self.cpu = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.ggml_linear import ggml_linear
        x2 = x.reshape(-1, self.in_features).contiguous()
        return ggml_linear(x2, self.blocks, self.type.code, self.out_features).view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return ggml.dequantize(self.type.name, self.blocks, self.out_features, self.in_features)


def device_kernel(device: torch.device) -> bool:
    """Dense blocks are kept on `device` where it is a GPU Triton runs on (the CPU has its own kernels above)."""
    from engine.kernels.quant_triton import available
    return device.type == "cuda" and available(device)


def native_kernel(ggml_type: str | int) -> bool:
    """A native CPU kernel computes this type here (the kernels built, and this type among theirs)."""
    from engine.kernels import native            # the kernels build with g++ at first use: not at import
    return native.ggml_supported(ggml.ggml_type(ggml_type).code)


def weight(name: str, ggml_type: str | int, shape: Sequence[int], raw, *, device: str | torch.device = "cpu",
           dtype: torch.dtype = torch.float32, linear: bool = True, rows: bool = False):
    """One GGUF tensor → what the engine computes with.

    name: the tensor's name (for messages); ggml_type: its GGML type, by name ("Q4_K") or code (GGUFReader's
    tensor_type); shape: torch order, [out, in] for a matrix (GGUFReader's `shape` is GGML order: reverse it);
    raw: its bytes as the file holds them (GGUFReader's `data`, any dtype/shape; copied).
    linear=True and a matrix: on the CPU its blocks are kept — Q4_1/Q4_K as torch's int4 operand (Int4Projection,
    where 64 rows tile it), Q8_0 as codes and scales (Q8Projection), every other quantized type as a
    BlockProjection — and float types become a Projection in `dtype`. On a GPU (where Triton runs) a linear matrix
    keeps its blocks too (DeviceBlockProjection). Elsewhere (no kernel for it there) the blocks are dequantized once
    to `dtype`, and the log says so; the result is then a
    Projection for linear=True, else a tensor (norms, biases, routers: linear=False).
    rows=True (with linear=True): the vocabulary, whose kept blocks also serve the embedding's lookups — the result
    has .rows(ids) (Q8Projection or BlockProjection; a float type's Projection: index its .weight's transpose).
    ValueError (its message names the tensor) for a type Kiln lacks or bytes that disagree with the shape."""
    try:
        t = ggml.ggml_type(ggml_type)
    except ggml.UnknownType as e:
        raise ValueError(f"{name}: {e}") from None
    shape = [int(n) for n in shape]
    if not shape or any(n <= 0 for n in shape):
        raise ValueError(f"{name}: shape {shape} is not a tensor's")
    out, inp = int(np.prod(shape[:-1])), shape[-1]
    try:
        nbytes = matrix_bytes(t.name, out, inp)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    blocks = _raw_tensor(raw, nbytes, name).view(out, -1)
    device = torch.device(device)
    is_matrix = len(shape) == 2
    if t.name in FLOAT_DTYPES:
        w = blocks.view(FLOAT_DTYPES[t.name]).reshape(shape).to(device=device, dtype=dtype)
        return Projection(w) if linear and is_matrix else w
    if linear and is_matrix and not rows and device_kernel(device):
        return DeviceBlockProjection(t.name, blocks.to(device), out, inp)
    if linear and is_matrix and device.type == "cpu":
        if t.name in ("q4_1", "q4_k") and out % INT4PACK_N == 0 and not rows:     # torch's int4 operand: no rows
            return Int4Projection([(t.name, blocks)])
        if t.name == "q8_0":
            q8 = blocks.view(out * inp // 32, 34)
            d = q8[:, :2].contiguous().view(torch.float16).float().view(out, inp // 32)
            return Q8Projection(q8[:, 2:].contiguous().view(torch.int8).view(out, inp), d)
        if native_kernel(t.name):
            return BlockProjection(t.name, blocks, out, inp)
    if linear and is_matrix:
        log.info("%s: no kernel keeps %s blocks on %s here; dequantized at load", name, t.name.upper(), device)
    w = ggml.dequantize(t.name, blocks, out, inp).reshape(shape).to(device=device, dtype=dtype)
    return Projection(w) if linear and is_matrix else w


class StackedProjection:
    """Projections of one input whose outputs are concatenated (q|k|v where the file holds them in different types:
    a Q4_K_M's Q5_0 q and k beside its Q8_0 v), each computed by its own type's kernel."""

    def __init__(self, parts: list):
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.cpu = all(p.cpu for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], -1)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


def projection(parts: Sequence[tuple[str, str | int, torch.Tensor]], *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, rows: bool = False, blocks_only: bool = False,
               device_blocks: bool = True):
    """Matrices (name, ggml_type, raw blocks uint8 [out, row bytes]) of one input, stacked along the output in order,
    as one projection: on the CPU 4-bit blocks of one type that torch's int4 operand tiles as one Int4Projection (one
    call: the native attention block takes it), else consecutive matrices of one type as one BlockProjection each
    (their rows concatenated; weight() where no native kernel has the type, or for the vocabulary) and several of
    those as a StackedProjection; on a GPU (Triton) each run of one type a DeviceBlockProjection; elsewhere the float
    weights concatenated, dequantized once. rows: one matrix, the vocabulary (on the CPU a BlockProjection where the
    native kernel has its type, else weight(rows=True)). blocks_only (EngineConfig.cpu_activations "int8"): on the
    CPU every run a BlockProjection, 4-bit ones too, since only the GGUF GEMVs round x to 8 bits. device_blocks=False
    (EngineConfig.gguf_dense): on a GPU the matrices dequantized once to `dtype`, as where no kernel keeps them."""
    got = []
    for name, t, raw in parts:
        g = ggml.ggml_type(t)
        raw = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
        raw = raw.reshape(raw.shape[0], -1) if raw.dim() else raw
        if g.name in FLOAT_DTYPES or raw.dim() != 2 or raw.shape[1] % g.size:
            raise ValueError(f"{name}: {g.name.upper()} blocks must be uint8 [out, row bytes] in whole {g.size}-byte blocks")
        got.append((name, g.name, raw, raw.shape[1] // g.size * g.block))
    if len({inp for *_, inp in got}) != 1:
        raise ValueError(f"{', '.join(n for n, *_ in got)}: stacked matrices need one input width, got "
                         f"{sorted({inp for *_, inp in got})}")
    inp = got[0][3]
    device = torch.device(device)
    if device.type != "cpu" and not rows and device_blocks and device_kernel(device):
        out = [DeviceBlockProjection(run[0][1], torch.cat([p[2] for p in run]).to(device),
                                     sum(p[2].shape[0] for p in run), inp) for run in _runs(got)]
        return out[0] if len(out) == 1 else StackedProjection(out)
    if device.type != "cpu":
        return Projection(torch.cat([weight(n, t, [b.shape[0], inp], b, device=device, dtype=dtype, linear=False)
                                     for n, t, b, _ in got]))
    if not rows and not blocks_only and len({t for _, t, *_ in got}) == 1 and got[0][1] in ("q4_1", "q4_k") \
            and all(b.shape[0] % INT4PACK_N == 0 for _, _, b, _ in got):
        return Int4Projection([(t, b) for _, t, b, _ in got])
    runs = _runs(got)
    # Every run a BlockProjection where the native kernel computes its type (Q8_0 and 4-bit ones too, which weight()
    # would hold as Q8Projection / Int4Projection), so the native attention block (engine.kernels.native.GgmlAttnBlock)
    # reads q|k|v and o as the file's blocks in one call. The vocabulary too (its .rows serve the embedding): a tied
    # Q8_0 one's one-row GEMV on the file's blocks (gemv512_row) took 1.04 ms where q8_gemv on its codes and fp32
    # scales took 1.65 (the demo's 49,152 x 576, 2 threads), the same products in another summation order.
    out = [BlockProjection(run[0][1], torch.cat([p[2] for p in run]), sum(p[2].shape[0] for p in run), inp)
           if native_kernel(run[0][1]) else
           weight("+".join(p[0] for p in run), run[0][1], [sum(p[2].shape[0] for p in run), inp],
                  torch.cat([p[2] for p in run]), rows=rows) for run in runs]
    return out[0] if len(out) == 1 else StackedProjection(out)


def _runs(got: list) -> list[list]:
    """Consecutive matrices of one type: one weight, one kernel call."""
    runs: list[list] = []
    for part in got:
        if runs and runs[-1][0][1] == part[1]:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def expert_layout(hidden: int, intermediate: int, types: Iterable[Sequence[str | int]], *,
                  order: str = "rows") -> ExpertLayout:
    """The record layout for MoE layers whose (gate, up, down) GGML types are `types` (one triple a layer): one
    GGUF scheme where every matrix of every layer is one of Q8_0, Q4_1, Q4_K alike (the kernels written for those),
    else a ggml: layout whose regions fit the widest type each matrix has. ValueError (naming the type and the
    width) where a type's block does not divide the row it would hold."""
    triples = {tuple(ggml.ggml_type(t).name for t in tr) for tr in types}
    if not triples:
        raise ValueError("no MoE layer's expert types")
    names = {n for tr in triples for n in tr}
    if len(names) == 1 and (only := names.pop()) in GGUF_BLOCK:
        return ExpertLayout(hidden, intermediate, torch.uint8, order, only)
    shapes = ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))
    widest = []
    for j, (o, i) in enumerate(shapes):
        kinds = sorted({tr[j] for tr in triples})
        for k in kinds:
            ggml.row_bytes(k, i)
        widest.append(max(kinds, key=lambda k: matrix_bytes(k, o, i)))
    return ExpertLayout(hidden, intermediate, torch.uint8, order, mixed_scheme(widest))


def expert_record(layout: ExpertLayout | QuantLayout, gate: tuple, up: tuple, down: tuple) -> torch.Tensor:
    """One record (uint8, record_bytes) from three (ggml_type, raw blocks [out, row bytes]) matrices."""
    q = layout.quantized if isinstance(layout, ExpertLayout) else layout
    mats, types = [], []
    for t, raw in (gate, up, down):
        types.append(ggml.ggml_type(t).name)
        mats.append(raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)))
    return q.pack_blocks(*mats, types=tuple(types))

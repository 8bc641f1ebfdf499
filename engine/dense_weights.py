"""Projection: a dense weight of the model (attention, shared MLP, lm_head), held the way its device multiplies it
fastest. The routed experts are not Projections: they are records (engine.experts)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.checkpoint import CheckpointError
from engine.kernels import native
from engine.kernels.quant_cpu import int4_mm
from engine.quant.gguf import GGUF_TYPES
from engine.quant.records import (FOUR_BIT, GGUF_BLOCK, INT4PACK_N, affine4, dequantize_int4pack,
                                  int4pack_operands, to_int4pack)


class Projection:
    """One of the model's own weights, [out, in] as the checkpoint has it, held the way its device
    multiplies fastest. On the CPU: transposed ([in, out], contiguous) — the orientation torch's BLAS
    streams at about twice the bandwidth for a one-row GEMV — and a one-row GEMV goes out as two column
    halves in one batched matmul: two intra-op threads share it, and each half runs sequentially, so the
    result has the same bits on one thread or several (a lone GEMV may be split by the BLAS itself, in
    another summation order: see engine.kernels.cpu.single_ffn). Every element is the dot product a sequential matmul
    computes (bitwise: tests/engine/test_speed_paths.py). Elsewhere: F.linear, as given."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.cpu = weight.device.type == "cpu"
        self.weight = weight.t().contiguous() if self.cpu else weight      # CPU: [in, out]
        out, size = self.out_features, weight.element_size()
        self.halves = self.cpu and out % 2 == 0 and (out // 2 * size) % 64 == 0   # each half's outputs 64-byte aligned

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cpu:
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:                # the bias added inside the GEMM, rounded once (as F.linear)
            return torch.addmm(self.bias, x.reshape(-1, self.in_features), self.weight).view(*x.shape[:-1], -1)
        if self.halves and x.numel() == x.shape[-1] and torch.get_num_threads() >= 2:
            n = self.out_features // 2
            y = torch.bmm(x.reshape(1, 1, -1).expand(2, 1, -1), self.weight.view(-1, 2, n).transpose(0, 1))
            return y.reshape(*x.shape[:-1], self.out_features)               # [2, 1, out/2] -> one row
        return torch.matmul(x, self.weight)


class Q8Projection:
    """A float32 weight [out, in] that is exactly 8-bit blocks — w = d·q, q in -127..127, one d per 32 inputs, as
    a GGUF's Q8_0 dequantizes (engine convert writes SmolLM2's tied vocabulary so) — held as those codes and
    scales (int8 [out, in], float32 [out, in/32]: 3.8x fewer bytes) and computed by the native GEMV
    (engine.kernels.native.q8_gemv: the same products in float32, another summation order than the BLAS).
    Only where `exact` finds every block so; a weight that is not keeps its float32 Projection."""

    CHUNK = 4096                     # rows dequantized at a time for a many-token matmul

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        self.q, self.d = q, d
        self.out_features, self.in_features = q.shape
        self.cpu = True

    @classmethod
    def exact(cls, w: torch.Tensor) -> "Q8Projection | None":
        """w's codes and scales where w [out, in] (float32, CPU, in % 32 == 0) is exactly d·q in every block,
        d = the block's largest |w| / 127 (the Q8_0 quantizer's scale: its largest code is ±127); else None.
        Checked in chunks of rows, so the load holds no float32 temporaries of the whole matrix."""
        out, inp = w.shape
        if w.dtype != torch.float32 or w.device.type != "cpu" or inp % 32:
            return None
        q, d = torch.empty(out, inp, dtype=torch.int8), torch.empty(out, inp // 32)
        for r in range(0, out, cls.CHUNK):
            blk = w[r:r + cls.CHUNK].reshape(-1, inp // 32, 32)
            scale = blk.abs().amax(-1) / 127
            codes = torch.where(scale[..., None] > 0, blk / scale[..., None], 0).round()
            if not (codes.abs().max() <= 127 and torch.equal(codes * scale[..., None], blk)):
                return None
            q[r:r + cls.CHUNK] = codes.reshape(-1, inp).to(torch.int8)
            d[r:r + cls.CHUNK] = scale
        return cls(q, d)

    def _dequantize(self, rows) -> torch.Tensor:
        q, d = self.q[rows], self.d[rows]
        return (q.float().view(*q.shape[:-1], -1, 32) * d[..., None]).flatten(-2)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (any shape) as float32 [..., in]: the same values the float weight holds."""
        return self._dequantize(ids)

    def dequantized(self) -> torch.Tensor:
        return self._dequantize(slice(None))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features:
            return native.q8_gemv(x.reshape(-1).contiguous(), self.q, self.d).view(*x.shape[:-1], -1)
        x2 = x.reshape(-1, self.in_features)
        if native.allowed():           # each row as the one-row GEMV computes it (exact prefill's all_logits)
            return native.q8_gemv_rows(x2.contiguous(), self.q, self.d).view(*x.shape[:-1], -1)
        y = torch.cat([x2 @ self._dequantize(slice(r, r + self.CHUNK)).t() for r in range(0, self.out_features, self.CHUNK)], -1)
        return y.view(*x.shape[:-1], -1)


# ---------------------------------------------------------------- a GGUF's own 4-bit blocks

BLOCKS_SUFFIX = "blocks_"      # checkpoint tensor `<name>.blocks_<scheme>`: a GGUF's raw blocks, uint8 [out, row bytes]
# The GGUF block schemes a dense weight is kept in: the 4-bit ones, which the CPU int4 kernel reads.
BLOCK_SCHEMES = tuple(s for s in GGUF_TYPES.values() if s in FOUR_BIT)


def block_shape(scheme: str, blocks: torch.Tensor) -> tuple[int, int]:
    """(out, in) of a rows-form block matrix uint8 [out, row bytes]."""
    per, size = GGUF_BLOCK[scheme]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise CheckpointError(f"{scheme} blocks must be uint8 [out, row bytes] in whole {size}-byte blocks; "
                              f"got {str(blocks.dtype).removeprefix('torch.')} {list(blocks.shape)}")
    out, row = blocks.shape
    return out, row // size * per


class Int4Projection:
    """A dense weight kept as the GGUF's own 4-bit blocks (Q4_1, Q4_K), held as torch's CPU int4 operand: the
    kernel the 4-bit expert records use (engine.kernels.quant_cpu), with its edges — x and y rounded to bf16,
    fp32 accumulation, the blocks' fp16 scales rounded to bf16 (engine.quant.records.affine4). Several
    matrices of one input (q, k, v) are stacked along the output into one call."""

    def __init__(self, parts: list[tuple[str, torch.Tensor]]):
        codes, sz, ins, groups = [], [], set(), set()
        for scheme, blocks in parts:
            out, inp = block_shape(scheme, blocks)
            q, s, g = affine4(scheme, blocks.reshape(-1), out, inp)
            codes.append(q)
            sz.append(s)
            ins.add(inp)
            groups.add(g)
        if len(ins) != 1 or len(groups) != 1:
            raise CheckpointError(f"stacked projections need one input width and group; got {sorted(ins)}, {sorted(groups)}")
        self.in_features, self.group = ins.pop(), groups.pop()
        self.out_features = sum(q.shape[0] for q in codes)
        self.cpu = True                      # torch's CPU int4 operand
        self._buf = to_int4pack(torch.cat(codes), torch.cat(sz))
        self.packed, self.sz = int4pack_operands(self._buf, self.out_features, self.in_features, self.group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = int4_mm(x.reshape(-1, self.in_features), self.packed, self.group, self.sz)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """float32 [out, in], as the kernel computes with it (the reference tests hold the kernel to)."""
        return dequantize_int4pack(self._buf, self.out_features, self.in_features, self.group)


def int4_fits(parts: list[tuple[str, torch.Tensor]]) -> bool:
    """torch's CPU int4 operand tiles 64 output rows and reads 32-weight groups."""
    return all(s in FOUR_BIT and block_shape(s, b)[0] % INT4PACK_N == 0 for s, b in parts)


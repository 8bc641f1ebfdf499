"""GGML's tensor types as a GGUF file stores them: every type a standard file uses (llama-quantize's Q2_K … Q8_0
mixes and the common dynamic quants), their block sizes, and the plain dequantization every kernel is held to.

A type's name here is GGML's in lower case ("q4_k"), its code GGML's own type id (what a GGUF file records and
what the kernels switch on: engine.kernels.native_cpu.cpp's ggml_gemv, engine.kernels.quant_triton's
_ggml_weights). Block layouts (bytes, in order; d, dmin, m fp16 unless said):
  f32 / f16 / bf16   one weight a "block"
  q4_0   (32, 18)  d | 16 bytes: weight j<16 the low nibble of byte j, j>=16 the high one of byte j-16; w = d(q-8)
  q4_1   (32, 20)  d | m | 16 bytes as q4_0; w = dq + m
  q5_0   (32, 22)  d | qh u32 (bit j: weight j's fifth bit) | 16 bytes as q4_0; w = d(q-16)
  q5_1   (32, 24)  d | m | qh u32 | 16 bytes; w = dq + m
  q8_0   (32, 34)  d | 32 int8; w = dq
  q2_k   (256, 84) 16 bytes of 4-bit (scale, min) per 16 weights | 64 bytes of 2-bit codes | d | dmin
  q3_k   (256, 110) hmask 32 | 64 bytes of 2-bit codes | 12 bytes of 6-bit signed scales | d
  q4_k   (256, 144) d | dmin | 12 bytes of 6-bit (scale, min) per 32 | 128 bytes of nibbles
  q5_k   (256, 176) d | dmin | 12 bytes of scales | qh 32 | 128 bytes of nibbles
  q6_k   (256, 210) ql 128 | qh 64 | 16 int8 scales | d
  iq4_nl (32, 18)  d | 16 bytes as q4_0, each code an index into IQ4_NL_VALUES; w = d·value
  iq4_xs (256, 136) d | scales_h u16 | scales_l 4 | 128 bytes (per 32: 16 bytes as iq4_nl); 6-bit signed scales
The plain dequantization is the gguf package's own (gguf.quants.dequantize, numpy, on the CPU): the engine's
fallback for records and dense weights without a kernel on their device, and the tests' oracle.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class GgmlType:
    name: str           # lower case: the engine's scheme name
    code: int           # GGML's type id (gguf.GGMLQuantizationType)
    block: int          # weights a block
    size: int           # bytes a block


TYPES = {t.name: t for t in (
    GgmlType("f32", 0, 1, 4), GgmlType("f16", 1, 1, 2), GgmlType("bf16", 30, 1, 2),
    GgmlType("q4_0", 2, 32, 18), GgmlType("q4_1", 3, 32, 20), GgmlType("q5_0", 6, 32, 22),
    GgmlType("q5_1", 7, 32, 24), GgmlType("q8_0", 8, 32, 34),
    GgmlType("q2_k", 10, 256, 84), GgmlType("q3_k", 11, 256, 110), GgmlType("q4_k", 12, 256, 144),
    GgmlType("q5_k", 13, 256, 176), GgmlType("q6_k", 14, 256, 210),
    GgmlType("iq4_nl", 20, 32, 18), GgmlType("iq4_xs", 23, 256, 136),
)}
BY_CODE = {t.code: t for t in TYPES.values()}
FLOAT_TYPES = ("f32", "f16", "bf16")
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class UnknownType(ValueError):
    """A GGML type Kiln has no layout or kernel for (named in the message)."""


def ggml_type(t: str | int) -> GgmlType:
    """The type by name (any case: "Q4_K", "q4_k") or by GGML code; UnknownType names what Kiln lacks."""
    found = BY_CODE.get(t) if isinstance(t, int) else TYPES.get(str(t).lower())
    if found is None:
        raise UnknownType(f"GGML type {t} is not one Kiln reads ({', '.join(n.upper() for n in TYPES)})")
    return found


def row_bytes(t: str | int, inp: int) -> int:
    """Bytes of one row of `inp` weights; ValueError where `inp` is not whole blocks."""
    g = ggml_type(t)
    if inp % g.block:
        raise ValueError(f"a row of {inp} weights is not whole {g.name} blocks of {g.block}")
    return inp // g.block * g.size


def matrix_bytes(t: str | int, out: int, inp: int) -> int:
    return out * row_bytes(t, inp)


def dequantize(t: str | int, buf: torch.Tensor | np.ndarray, out: int, inp: int) -> torch.Tensor:
    """Raw blocks of an [out, in] matrix (uint8, out·row_bytes long, any shape) → float32 [out, in] on the CPU, by
    gguf.quants.dequantize: the reference every kernel here is tested against."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    g = ggml_type(t)
    if isinstance(buf, torch.Tensor):
        buf = buf.detach().reshape(-1).cpu().numpy()
    raw = np.ascontiguousarray(buf, dtype=np.uint8).reshape(out, row_bytes(g.name, inp))
    w = gguf_dequantize(raw, GGMLQuantizationType(g.code))
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(out, inp))

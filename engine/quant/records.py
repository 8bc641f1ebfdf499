"""Byte layouts of quantized expert records, how to make them, and the plain dequantization they mean.

A quantized record is still ONE slot: gate, up and down with their scales (and zero points) inside it,
each matrix's bytes starting 64-byte aligned, the whole padded to 4 KiB. Quantization is weight-only and
group-wise along the input dimension (each output row's `in` weights in groups of `group_size(in)`).

Schemes (the manifest's `quant`):
  int8  from a float checkpoint: symmetric, w = q·s, q ∈ [-127, 127], s fp16 per group, the best of a few
        candidates (quantize_int8). Symmetric keeps the kernels a plain scale.
  int4  from a float checkpoint: asymmetric, w = (q - 8)·s + z, q ∈ [0, 15], s and z bf16 per group.
        4 bits leave 16 levels: a zero point lets a skewed group use all of them (bench/quant_accuracy.py
        measures int4 vs its baseline); the (q - 8)·s + z form with bf16 s, z is exactly what torch's CPU
        int4 kernel computes, so the CPU layout below re-encodes it losslessly.
  q8_0, q4_1, q4_k  GGUF's own blocks, byte for byte (from a GGUF file, engine.quant.gguf): q8_0 w = d·q
        (32 per block), q4_1 w = d·q + m (32), q4_k w = d·sc·q - dmin·m (256, 6-bit sub-block scales).

Orders, as for float records (engine.experts): `rows` is the form above, matrix by matrix (what the GPU
kernels read; for GGUF schemes the file's blocks unchanged). `cols` is the CPU kernel's form: for the
4-bit schemes gate|up as one [2I, H] matrix and down, each in torch's int4pack tiling
(torch.ops.aten._convert_weight_to_int4pack_for_cpu) with bf16 (scale, zero) pairs [in/group, out, 2],
the operand torch.ops.aten._weight_int4pack_mm_for_cpu reads; the 4-bit codes are the same, q4_1's and
q4_k's fp16-derived scales are rounded to bf16 (int4's already are). For the 8-bit schemes cols == rows.

ggml:G,U,D  a GGUF's own blocks, each matrix in its own GGML type (engine.quant.ggml: every standard type), for
        files whose experts mix types (llama-quantize's Q4_K_M keeps ffn_down_exps in Q6_K in half the layers;
        rows not a multiple of 256 fall back to Q5_0 or Q8_0). G, U, D name the record's CAPACITY: each region is
        sized for that type, the widest its matrix has in the store, and every record carries its own three
        types in a 64-byte header (RecordHeader) before them, so one slot size serves every layer and a kernel
        learns a record's types from the record itself (no per-layer table beside the slot). Both orders hold
        the same bytes: the CPU's native kernel reads the blocks as they are (engine.kernels.native.ggml_gemv).

Group size: 32 for int8 and int4 (GROUP, chosen by measurement: bench/quant_accuracy.py), so the manifest's
scheme fixes it and needs no field for it. GGUF schemes keep their block sizes (32; q4_k 256 with
32-wide sub-blocks).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from engine.quant import ggml

ALIGN = 4096
MATRIX_ALIGN = 64
SCHEMES = ("int8", "int4", "q8_0", "q4_1", "q4_k")
FROM_FLOAT = ("int8", "int4")
GGUF_BLOCK = {"q8_0": (32, 34), "q4_1": (32, 20), "q4_k": (256, 144)}   # scheme -> (weights, bytes) per block
FOUR_BIT = ("int4", "q4_1", "q4_k")
# Weights per scale of the schemes quantized here: 32 for both, chosen by bench/quant_accuracy.py
# (bench/results/quant_accuracy.json: groups 32/64/128 on SmolLM2 and on a bf16 synthetic checkpoint).
# int4: SmolLM2's weights come from a Q4_1 GGUF (groups of 32, min/max), so a 32-group min/max grid lands
# on the file's own grid, while a 64- or 128-group one falls between it. The price is bytes: 5 bits a
# weight (Q4_1's, Q8_0's 8.5 for int8) against 4.25 (8.125) at 128.
GROUP = {"int8": 32, "int4": 32}
INT4PACK_N = 64        # torch's CPU int4pack tiles 64 output rows together
MIXED = "ggml:"        # scheme prefix of per-matrix-typed GGUF records: "ggml:q4_k,q4_k,q6_k"
HEADER = 64            # bytes before a ggml: record's matrices: MAGIC, then the three GGML type codes
MAGIC = b"KGGM"


def mixed_scheme(types) -> str:
    """The scheme of records whose regions fit `types` (gate, up, down names)."""
    return MIXED + ",".join(ggml.ggml_type(t).name for t in types)


def mixed_types(scheme: str) -> tuple[str, str, str] | None:
    """(gate, up, down) type names of a ggml: scheme, else None."""
    if not scheme.startswith(MIXED):
        return None
    names = scheme[len(MIXED):].split(",")
    if len(names) != 3:
        raise ValueError(f"quant scheme {scheme!r} names {len(names)} types, not gate,up,down")
    return tuple(ggml.ggml_type(n).name for n in names)  # type: ignore[return-value]


def is_scheme(scheme: str) -> bool:
    try:
        return scheme in SCHEMES or mixed_types(scheme) is not None
    except ValueError:
        return False


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


def group_size(inp: int, scheme: str = "int4") -> int:
    """Weights per scale along the input dimension."""
    if scheme in GGUF_BLOCK:
        return 32 if scheme == "q4_k" else GGUF_BLOCK[scheme][0]    # q4_k: its sub-blocks carry the scales
    g = GROUP[scheme]
    if inp % g:
        raise ValueError(f"input dimension {inp} is not a multiple of {scheme}'s group {g}, so it cannot be "
                         f"quantized group-wise")
    return g


# ------------------------------------------------------------------ one matrix [out, in], rows form

def matrix_bytes(scheme: str, out: int, inp: int, group: int | None = None) -> int:
    """Bytes of one matrix in the rows form (int8/int4: `group` weights per scale, else group_size's)."""
    if scheme in GGUF_BLOCK:
        per, size = GGUF_BLOCK[scheme]
        return out * (inp // per) * size
    if scheme in ggml.TYPES:
        return ggml.matrix_bytes(scheme, out, inp)
    ng = inp // (group or group_size(inp, scheme))
    if scheme == "int8":
        return out * inp + out * ng * 2
    return out * inp // 2 + out * ng * 4


# int8's scale candidates: s = absmax/n, n = 127, 126, ..., 96, each rounded to fp16 as stored; the one with
# the least squared error over its group is kept (ties: the largest n). absmax/127 alone leaves SmolLM2's
# weights 0.54 % off in groups of 32 (relative), 4x bf16's rounding, and costs it 2 % of its top-1; the
# search halves that error on a checkpoint converted from a 4-bit GGUF (a grid the int8 one can be laid
# on: top-1 0.993) and cuts it by about a tenth on Gaussian weights (bench/quant_accuracy.py,
# bench/probes/quant_noise_floor.py). A pack-time cost only (32 candidates): the format is unchanged.
INT8_SCALE_DIVISORS = tuple(range(127, 95, -1))
_SEARCH_ROWS = 64           # rows searched at once: candidates x rows x in floats stay a few MB


def _int8_scales(wg: torch.Tensor, divisors: tuple[int, ...]) -> torch.Tensor:
    """[rows, groups, g] float32 → the fp16 scale of each group [rows, groups], the best of absmax/n."""
    n = torch.tensor(divisors, dtype=torch.float32, device=wg.device)
    out = []
    for part in wg.split(_SEARCH_ROWS):
        amax = part.abs().amax(-1, keepdim=True)                         # [r, ng, 1]
        cand = (amax / n).to(torch.float16).float()                      # [r, ng, C]
        safe = torch.where(cand > 0, cand, 1)[..., None]
        err = ((torch.round(part[..., None, :] / safe).clamp(-127, 127) * safe - part[..., None, :]) ** 2).sum(-1)
        best = err.argmin(-1, keepdim=True)                              # first minimum: the largest n
        out.append(cand.gather(-1, best)[..., 0].to(torch.float16))
    return torch.cat(out)


def quantize_int8(w: torch.Tensor, group: int | None = None,
                  divisors: tuple[int, ...] = INT8_SCALE_DIVISORS) -> torch.Tensor:
    """[out, in] float → rows-form bytes: q int8 [out, in] | s fp16 [out, in/g]; s the best of absmax/n for n
    in `divisors` (see INT8_SCALE_DIVISORS; (127,) is plain absmax scaling), the codes rounded for that
    fp16 value."""
    out, inp = w.shape
    g = group or group_size(inp, "int8")
    wg = w.float().reshape(out, inp // g, g)
    s = _int8_scales(wg, divisors)
    sf = s.float()
    q = torch.where(sf[..., None] > 0, torch.round(wg / torch.where(sf > 0, sf, 1)[..., None]), 0)
    q = q.clamp(-127, 127).to(torch.int8)
    return torch.cat([q.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8)])


def quantize_int4(w: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """[out, in] float → rows-form bytes: codes [out, in/2] (byte j: q[2j] | q[2j+1] << 4) | (s, z) bf16
    [out, in/g, 2], w ≈ (q - 8)·s + z. s and z are rounded to bf16 first and the codes chosen for the
    rounded values, so dequantization reproduces exactly what the codes were fitted to."""
    out, inp = w.shape
    g = group or group_size(inp, "int4")
    wg = w.float().reshape(out, inp // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = ((hi - lo) / 15).to(torch.bfloat16).float()
    z = (lo + 8 * s).to(torch.bfloat16).float()
    q = torch.where(s[..., None] > 0, torch.round((wg - z[..., None]) / torch.where(s > 0, s, 1)[..., None]) + 8, 8)
    q = q.clamp(0, 15).to(torch.uint8).reshape(out, inp)
    codes = q[:, 0::2] | (q[:, 1::2] << 4)
    sz = torch.stack([s, z], -1).to(torch.bfloat16)
    return torch.cat([codes.reshape(-1), sz.reshape(-1).view(torch.uint8)])


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 → [n, 1] float32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles_lo_hi(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes → [..., 2n] codes: the n low nibbles, then the n high ones (GGUF's block order)."""
    return torch.cat([qs & 15, qs >> 4], -1)


def _q4_k_scales(sc_bytes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, 12] → (sc, m) [nb, 8]: the 6-bit sub-block scales and mins (ggml's get_scale_min_k4)."""
    d, m, md = sc_bytes[:, 0:4], sc_bytes[:, 4:8], sc_bytes[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


def dequantize_matrix(scheme: str, buf: torch.Tensor, out: int, inp: int, group: int | None = None) -> torch.Tensor:
    """Rows-form bytes → float32 [out, in]: the reference every kernel is tested against (int8/int4 made with
    `group`, else group_size's). The GGUF schemes compute as gguf's own dequantize does, operation for
    operation (bitwise equal)."""
    if scheme == "int8":
        g = group or group_size(inp, scheme)
        q = buf[:out * inp].view(torch.int8).reshape(out, inp // g, g).float()
        s = buf[out * inp:].view(torch.float16).reshape(out, inp // g, 1).float()
        return (q * s).reshape(out, inp)
    if scheme == "int4":
        g = group or group_size(inp, scheme)
        codes = buf[:out * inp // 2].reshape(out, inp // 2)
        q = torch.stack([codes & 15, codes >> 4], -1).reshape(out, inp // g, g).float()
        sz = buf[out * inp // 2:].view(torch.bfloat16).reshape(out, inp // g, 2).float()
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(out, inp)
    if scheme not in GGUF_BLOCK:       # the other GGML types: gguf's own dequantization (on the CPU)
        return ggml.dequantize(scheme, buf, out, inp).to(buf.device)
    per, size = GGUF_BLOCK[scheme]
    blocks = buf.reshape(out * inp // per, size)
    if scheme == "q8_0":
        d = _fp16(blocks[:, 0:2])
        return (d * blocks[:, 2:].contiguous().view(torch.int8).float()).reshape(out, inp)
    if scheme == "q4_1":
        d, m = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
        return (d * _nibbles_lo_hi(blocks[:, 4:]).float() + m).reshape(out, inp)
    # q4_k: 4 chunks of 64 weights, each 32 bytes of qs: low nibbles are sub-block 2c, high ones 2c+1.
    d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
    sc, mn = _q4_k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], 2).reshape(-1, 8, 32).float()
    ds = (d * sc.float()).reshape(-1, 8, 1)
    dm = (dmin * mn.float()).reshape(-1, 8, 1)
    return (ds * q - dm).reshape(out, inp)


def affine4(scheme: str, buf: torch.Tensor, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A 4-bit rows-form matrix as (codes [out, in] uint8 in 0..15, (s, z) float32 [out, in/g, 2], g) with
    w = (q - 8)·s + z: the form torch's int4 kernel computes in (exact for int4; for q4_1 z = m + 8d and
    for q4_k s = d·sc, z = 8·d·sc - dmin·m, whose bf16 rounding happens in to_int4pack)."""
    if scheme == "int4":
        g = group_size(inp, scheme)
        codes = buf[:out * inp // 2].reshape(out, inp // 2)
        q = torch.stack([codes & 15, codes >> 4], -1).reshape(out, inp)
        return q, buf[out * inp // 2:].view(torch.bfloat16).reshape(out, inp // g, 2).float(), g
    per, size = GGUF_BLOCK[scheme]
    blocks = buf.reshape(out * inp // per, size)
    if scheme == "q4_1":
        d, m = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
        q = _nibbles_lo_hi(blocks[:, 4:]).reshape(out, inp)
        return q, torch.cat([d, m + 8 * d], -1).reshape(out, inp // 32, 2), 32
    if scheme == "q4_k":
        d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
        sc, mn = _q4_k_scales(blocks[:, 4:16])
        s = d * sc.float()
        z = 8 * s - dmin * mn.float()
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
        q = torch.cat([qs & 15, qs >> 4], 2).reshape(out, inp)
        return q, torch.stack([s, z], -1).reshape(out, inp // 32, 2), 32
    raise ValueError(f"{scheme} is not a 4-bit scheme")


# ------------------------------------------------------------------ torch's CPU int4 operand

def to_int4pack(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """(codes [out, in], (s, z) [out, ng, 2]) → bytes: torch's int4pack codes [out·in/2] | (s, z) bf16
    [ng, out, 2], the operands of torch.ops.aten._weight_int4pack_mm_for_cpu."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    sz_t = sz.transpose(0, 1).to(torch.bfloat16).contiguous()
    return torch.cat([packed.reshape(-1), sz_t.reshape(-1).view(torch.uint8)])


def int4pack_operands(buf: torch.Tensor, out: int, inp: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one cols-form 4-bit matrix: (int4pack codes [out, in/2] uint8, (s, z) bf16 [in/g, out, 2])."""
    n = out * inp // 2
    return buf[:n].view(out, inp // 2), buf[n:n + out * (inp // g) * 4].view(torch.bfloat16).view(inp // g, out, 2)


def unpack_int4pack(packed: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """torch's int4pack tiling undone → codes [out, in]: per 64 output rows, for each input k, 32 bytes
    whose low nibbles are rows 0..31 and high nibbles rows 32..63 (asserted against torch by
    tests/engine/test_quant.py, so a torch that changes its tiling fails there, not silently)."""
    t = packed.reshape(out // INT4PACK_N, inp, INT4PACK_N // 2)
    q = torch.stack([t & 15, t >> 4], 2)                          # [nb, in, 2, 32]: row = 32·half + j
    return q.permute(0, 2, 3, 1).reshape(out, inp)


def dequantize_int4pack(buf: torch.Tensor, out: int, inp: int, g: int) -> torch.Tensor:
    """A cols-form 4-bit matrix → float32 [out, in], as the int4 kernel's (q - 8)·s + z."""
    packed, sz = int4pack_operands(buf, out, inp, g)
    q = unpack_int4pack(packed, out, inp).float().reshape(out, inp // g, g)
    sz = sz.float().transpose(0, 1)                               # [out, ng, 2]
    return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(out, inp)


# ------------------------------------------------------------------ the record

@dataclass(frozen=True)
class QuantLayout:
    """One quantized expert record: gate [I,H], up [I,H], down [H,I] in `scheme`, `order` rows or cols."""

    hidden: int
    intermediate: int
    scheme: str
    order: str = "rows"

    def __post_init__(self):
        assert is_scheme(self.scheme), f"quant scheme {self.scheme!r} is not one of {SCHEMES} or {MIXED}G,U,D"
        assert self.order in ("rows", "cols"), f"record order {self.order!r}"
        if self.mixed:
            for t, inp in zip(self.capacity, (self.hidden, self.hidden, self.intermediate)):
                ggml.row_bytes(t, inp)          # ValueError: not whole blocks
            return
        for inp in (self.hidden, self.intermediate):
            if self.scheme in GGUF_BLOCK:
                per = GGUF_BLOCK[self.scheme][0]
                assert inp % per == 0, f"input dimension {inp} is not a multiple of {self.scheme}'s block {per}"
            else:
                group_size(inp, self.scheme)
        if self.cpu_int4:
            assert self.hidden % INT4PACK_N == 0 and 2 * self.intermediate % INT4PACK_N == 0, \
                f"the CPU int4 layout tiles {INT4PACK_N} output rows: hidden and 2 x intermediate must be multiples"

    @property
    def mixed(self) -> bool:
        """Records of per-matrix GGML types behind a header (a ggml: scheme)."""
        return self.scheme.startswith(MIXED)

    @property
    def capacity(self) -> tuple[str, str, str]:
        """The types each region is sized for (gate, up, down); a one-type scheme's three times."""
        return mixed_types(self.scheme) or (self.scheme,) * 3

    @property
    def cpu_int4(self) -> bool:
        """The record holds torch's int4pack operands (cols order of a 4-bit scheme)."""
        return self.order == "cols" and self.scheme in FOUR_BIT

    @cached_property
    def regions(self) -> dict[str, tuple[int, int, int, int]]:
        """name -> (byte offset, bytes, out, in); rows: gate, up, down; cols 4-bit: gate_up, down."""
        h, i = self.hidden, self.intermediate
        if self.cpu_int4:
            shapes = {"gate_up": (2 * i, h), "down": (h, i)}
        else:
            shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
        out, off = {}, HEADER if self.mixed else 0
        for (name, (o, n)), t in zip(shapes.items(), self.capacity):
            size = self._cols_bytes(o, n) if self.cpu_int4 else matrix_bytes(t, o, n)
            out[name] = (off, size, o, n)
            off = _up(off + size, MATRIX_ALIGN)
        return out

    def _cols_bytes(self, out: int, inp: int) -> int:
        return out * inp // 2 + out * (inp // group_size(inp, self.scheme)) * 4

    @property
    def payload_bytes(self) -> int:
        off, size, _, _ = list(self.regions.values())[-1]
        return off + size

    @property
    def record_bytes(self) -> int:
        return _up(self.payload_bytes, ALIGN)

    def region(self, rec: torch.Tensor, name: str) -> torch.Tensor:
        off, size, _, _ = self.regions[name]
        return rec[off:off + size]

    # -- making records ------------------------------------------------------------------------
    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Quantize float matrices (int8/int4) into one record (uint8, record_bytes, zero padding)."""
        assert self.scheme in FROM_FLOAT, f"{self.scheme} records come from GGUF blocks (pack_blocks)"
        enc = quantize_int8 if self.scheme == "int8" else quantize_int4
        return self._assemble([enc(gate), enc(up), enc(down)])

    def pack_blocks(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                    types: tuple[str, str, str] | None = None) -> torch.Tensor:
        """GGUF blocks (uint8 [out, row bytes] as the file holds them) into one record, bytes unchanged in rows.
        types: each matrix's GGML type (a ggml: layout; None: its capacity), each no wider than its region."""
        assert self.scheme in GGUF_BLOCK or self.mixed, f"{self.scheme} records are quantized from floats (pack)"
        types = tuple(ggml.ggml_type(t).name for t in types) if types is not None else self.capacity
        if not self.mixed and types != self.capacity:
            raise ValueError(f"{'/'.join(types)} blocks in a {self.scheme} record (a ggml: layout keeps types per matrix)")
        h, i = self.hidden, self.intermediate
        mats = []
        for name, m, t, (o, n) in zip(("gate", "up", "down"), (gate, up, down), types, ((i, h), (i, h), (h, i))):
            want = matrix_bytes(t, o, n)
            if m.dtype != torch.uint8 or m.numel() != want:
                raise ValueError(f"{name}: {m.numel()} bytes of {m.dtype}, a [{o}x{n}] {t} matrix is {want}")
            if self.mixed and want > self.regions[name][1]:
                raise ValueError(f"{name}: a {t} matrix ({want} bytes) does not fit this layout's {self.capacity} "
                                 f"region ({self.regions[name][1]} bytes)")
            mats.append(m.reshape(-1))
        if not self.mixed:
            return self._assemble(mats)
        rec = torch.zeros(self.record_bytes, dtype=torch.uint8)
        rec[:HEADER] = torch.tensor(list(header_bytes(types)), dtype=torch.uint8)
        for (off, _, _, _), m in zip(self.regions.values(), mats):
            rec[off:off + m.numel()] = m
        return rec

    def record_types(self, rec: torch.Tensor) -> tuple[str, str, str]:
        """(gate, up, down) GGML types of one record: its header's (a ggml: layout), else the scheme's."""
        if not self.mixed:
            return self.capacity
        return read_header(bytes(rec.reshape(-1)[:HEADER].view(torch.uint8).cpu().numpy()))

    def _assemble(self, rows_form: list[torch.Tensor]) -> torch.Tensor:
        """Three rows-form matrices → the record in this layout's order."""
        rec = torch.zeros(self.record_bytes, dtype=torch.uint8)
        if self.cpu_int4:
            h, i = self.hidden, self.intermediate
            (qg, szg, g), (qu, szu, _) = affine4(self.scheme, rows_form[0], i, h), affine4(self.scheme, rows_form[1], i, h)
            mats = [to_int4pack(torch.cat([qg, qu]), torch.cat([szg, szu])),
                    to_int4pack(*affine4(self.scheme, rows_form[2], h, i)[:2])]
        else:
            mats = rows_form
        for (off, size, _, _), m in zip(self.regions.values(), mats):
            assert m.numel() == size, (m.numel(), size)
            rec[off:off + size] = m
        return rec

    # -- reading records -----------------------------------------------------------------------
    def dequantize(self, rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I,H], up [I,H], down [H,I]) float32: what every kernel on this record must compute with."""
        rec = rec.reshape(-1)
        if rec.dtype != torch.uint8:
            rec = rec.view(torch.uint8)
        if self.cpu_int4:
            i = self.intermediate
            mats = [dequantize_int4pack(self.region(rec, n), o, k, group_size(k, self.scheme))
                    for n, (_, _, o, k) in self.regions.items()]
            return mats[0][:i], mats[0][i:], mats[1]
        types = self.record_types(rec)
        return tuple(dequantize_matrix(t, self.region(rec, n)[:matrix_bytes(t, o, k)], o, k)  # type: ignore[return-value]
                     for t, (n, (_, _, o, k)) in zip(types, self.regions.items()))


def header_bytes(types) -> bytes:
    """A ggml: record's header: MAGIC, the three GGML type codes, zeros to HEADER bytes."""
    return (MAGIC + bytes(ggml.ggml_type(t).code for t in types)).ljust(HEADER, b"\0")


def read_header(head: bytes) -> tuple[str, str, str]:
    """The (gate, up, down) type names a ggml: record's header holds; ValueError when it is not one."""
    if head[:4] != MAGIC:
        raise ValueError(f"no ggml record header (starts {head[:4]!r}, not {MAGIC!r})")
    return tuple(ggml.ggml_type(c).name for c in head[4:7])  # type: ignore[return-value]

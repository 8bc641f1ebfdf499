"""The record layout: how one routed expert is stored, cached and computed — ONE flat record in the checkpoint
dtype (or a quantized record's bytes), padded to 4 KiB so a record read with O_DIRECT lands directly in a cache
slot (the store's record layout equals a compute slot). Its matrices come in one of two orders, chosen for the
device that computes from the slot:
  rows  gate [I,H] | up [I,H] | down [H,I], as the checkpoint holds them: the GPU kernels' order;
  cols  the same matrices transposed, gate and up side by side: gate_up^T [H,2I] | down^T [I,H].
        A one-token GEMV over a [in, out] matrix streams at about twice the bandwidth of one over
        [out, in] in the CPU's BLAS (bench/results/gemv_orientation.json), and gate|up is one matrix.
views() gives the same logical (gate, up, down) in both orders, so the arithmetic never changes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.quant.expert import QuantExpert
from engine.quant.records import QuantLayout

ALIGN = 4096

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


ORDERS = ("rows", "cols")


def order_for(device) -> str:
    """The record order a device computes fastest from: cols on the CPU, rows for the GPU kernels."""
    return "cols" if torch.device(device).type == "cpu" else "rows"


@dataclass(frozen=True)
class ExpertLayout:
    """Byte layout of one expert record (see the module docstring for the two orders), padded to ALIGN.
    quant != "none": a quantized record (engine.quant.records, which owns those layouts); its dtype is
    uint8 (the bytes a slot holds) and views() gives an engine.quant.expert.QuantExpert, which unpacks to
    the same logical (gate, up, down), dequantized (engine.tiers.waves computes it with the device's quantized
    kernel instead)."""

    hidden: int
    intermediate: int
    dtype: torch.dtype
    order: str = "rows"
    quant: str = "none"

    def __post_init__(self):
        assert self.hidden > 0 and self.intermediate > 0, "expert shape must be positive"
        assert self.order in ORDERS, f"record order {self.order!r} is not one of {ORDERS}"
        if self.quant == "none":
            assert self.dtype in _DTYPE_BYTES, f"unsupported expert dtype {self.dtype}"
            quantized = None
        else:
            assert self.dtype == torch.uint8, f"quantized records are bytes (uint8), not {self.dtype}"
            quantized = QuantLayout(self.hidden, self.intermediate, self.quant, self.order)
        object.__setattr__(self, "_q", quantized)

    @property
    def quantized(self) -> QuantLayout | None:
        """The engine.quant.records.QuantLayout of a quantized record, else None."""
        return self._q

    @property
    def itemsize(self) -> int:
        return 1 if self.quantized else _DTYPE_BYTES[self.dtype]

    @property
    def matrix_elems(self) -> int:
        return self.hidden * self.intermediate

    @property
    def payload_bytes(self) -> int:
        if self.quantized:
            return self.quantized.payload_bytes
        return 3 * self.matrix_elems * self.itemsize

    @functools.cached_property          # read per decode layer by the tiered provider; the layout is frozen
    def record_bytes(self) -> int:
        return -(-self.payload_bytes // ALIGN) * ALIGN

    @property
    def record_elems(self) -> int:
        return self.record_bytes // self.itemsize

    def views(self, slot: torch.Tensor):
        """(gate [I,H], up [I,H], down [H,I]) as views into a flat slot tensor of record_elems in self.dtype
        (in the cols order they are transposed views: the same values, other strides). A quantized
        record: a QuantExpert over the slot (it unpacks to the dequantized three)."""
        if self.quantized:
            return QuantExpert(self.quantized, slot)
        n, h, i = self.matrix_elems, self.hidden, self.intermediate
        if self.order == "cols":
            gate_up_t = slot[0:2 * n].view(h, 2 * i)
            return gate_up_t[:, :i].t(), gate_up_t[:, i:].t(), slot[2 * n:3 * n].view(i, h).t()
        gate = slot[0:n].view(i, h)
        up = slot[n:2 * n].view(i, h)
        down = slot[2 * n:3 * n].view(h, i)
        return gate, up, down

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """One record (flat, record_elems long, zero padding) from the three matrices (quantized at
        pack time for int8/int4; GGUF blocks go through QuantLayout.pack_blocks)."""
        assert gate.shape == (self.intermediate, self.hidden), f"gate shape {tuple(gate.shape)}"
        assert up.shape == (self.intermediate, self.hidden), f"up shape {tuple(up.shape)}"
        assert down.shape == (self.hidden, self.intermediate), f"down shape {tuple(down.shape)}"
        if self.quantized:
            return self.quantized.pack(gate, up, down)
        rec = torch.zeros(self.record_elems, dtype=self.dtype)
        for view, m in zip(self.views(rec), (gate, up, down)):
            view.copy_(m)
        return rec



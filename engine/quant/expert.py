"""QuantExpert: what ExpertLayout.views() gives for a quantized record.

Unpacks like the float views — `gate, up, down = layout.views(slot)` gives the dequantized matrices
(float32), so moe_reference and every plain path read a quantized store unchanged — and .ffn(x) computes
the expert from the record's bytes with the device's quantized kernel (engine.kernels.quant_cpu), which
moe_forward prefers.
"""
from __future__ import annotations

import torch

from engine.quant.records import QuantLayout


class QuantExpert:
    __slots__ = ("layout", "record")

    def __init__(self, layout: QuantLayout, record: torch.Tensor):
        self.layout, self.record = layout, record

    def __iter__(self):
        return iter(self.layout.dequantize(self.record))

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.quant_cpu import quant_ffn
        return quant_ffn(self.layout, self.record, x)

"""QuantExpert: what ExpertLayout.views() gives for a quantized record.

Unpacks like the float views — `gate, up, down = layout.views(slot)` gives the dequantized matrices
(float32), so moe_reference and every plain path read a quantized store unchanged. moe_forward
(engine.tiers.waves) computes it from the record's bytes with the device's quantized kernel instead
(engine.kernels.quant_cpu.quant_ffn): this record type stays below the kernels.
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

"""The GPU tier: record-sized slots in one device tensor, capped by free VRAM minus a reserve."""
from __future__ import annotations

import logging

import torch

from engine.experts import ExpertLayout

log = logging.getLogger("engine.tiers")
GIB = 1 << 30


def default_gpu_slots(device: torch.device, record_bytes: int, records: int, reserve: int | None = None) -> int:
    """Free VRAM minus a reserve (KV cache, activations, CUDA graphs grow after the tiers are built)."""
    free, total = torch.cuda.mem_get_info(device)
    reserve = max(4 * GIB, total // 10) if reserve is None else reserve
    slots = max(0, min(records, (free - reserve) // record_bytes))
    log.info("GPU tier: %d of %d expert records (%.2f GiB): %.1f GiB free - %.1f GiB reserve",
             slots, records, slots * record_bytes / GIB, free / GIB, reserve / GIB)
    return slots


class GpuArena:
    def __init__(self, slots: int, layout: ExpertLayout, device: torch.device):
        self.slots, self.layout = slots, layout
        self.data = torch.empty((slots, layout.record_elems), dtype=layout.dtype, device=device)

    def tensor(self, slot: int) -> torch.Tensor:
        return self.data[slot]

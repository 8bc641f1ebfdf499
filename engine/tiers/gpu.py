"""The GPU tier of the tiered provider: record-sized slots in one device tensor, filled from the RAM
tier by copies on a side stream, so that the compute stream only waits where it reads a slot.

Ordering, in the two directions a slot is shared:
- a copy into a slot is issued after everything already launched on the compute stream (an evicted
  slot may still be read by a kernel in flight): the copy stream waits on the compute stream;
- a kernel reading a slot runs after its copy: the compute stream waits on the copies' event
  (wait_copies), once per layer, not per expert.
The RAM tier's slots feed these copies, so it waits for them (copies_done) before a refill.
"""
from __future__ import annotations

import logging

import torch

from engine.experts import ExpertLayout
from engine.tiers.cache import ExpertCache, ExpertKey, make_policy

log = logging.getLogger("engine.tiers")
GIB = 1 << 30


def default_gpu_slots(device: torch.device, record_bytes: int, records: int, reserve: int | None = None) -> int:
    """Free VRAM minus a reserve (KV cache, activations, CUDA graphs grow after the tiers are built)."""
    free, total = torch.cuda.mem_get_info(device)
    reserve = gpu_reserve(total) if reserve is None else reserve
    slots = max(0, min(records, (free - reserve) // record_bytes))
    log.info("GPU tier: %d of %d expert records (%.2f GiB): %.1f GiB free - %.1f GiB reserve",
             slots, records, slots * record_bytes / GIB, free / GIB, reserve / GIB)
    return slots


def gpu_reserve(total: int) -> int:
    """VRAM kept free beside the experts: the non-expert weights, KV cache, activations and graphs."""
    return max(4 * GIB, total // 10)


class GpuTier:
    """`slots` expert slots on `device` (an ExpertCache names their occupants), loaded from RamTier slots."""

    def __init__(self, slots: int, layout: ExpertLayout, device: torch.device, policy: str):
        self.layout, self.device = layout, device
        self.cache = ExpertCache("gpu", slots, make_policy(policy))
        self.data = torch.empty((slots, layout.record_elems), dtype=layout.dtype, device=device)
        self.copy_stream = torch.cuda.Stream(device)
        self.copies_done = torch.cuda.Event()
        self.pending = False                 # copies issued that the compute stream has not waited for
        self.copy_bytes = 0

    def load(self, layer: int, experts: list[int], ram, pinned: set) -> set[int]:
        """Issue the copies that make each expert of `layer` resident in a GPU slot (does not wait for
        them); the RAM tier fetches from the store what it lacks, in chunks of its capacity. Keys in
        `pinned` are never evicted. → the experts that came from the store."""
        need = [e for e in experts if ExpertKey(layer, e) not in self.cache]
        from_store: set[int] = set()
        step = max(1, ram.cache.capacity)
        for i in range(0, len(need), step):
            chunk = need[i:i + step]
            # The RAM tier holds only this chunk for its copies (a refill waits for them), so it pins only the
            # chunk: pinning every GPU-pinned key there too could pin all of a small RAM tier.
            ram_slots, missed = ram.fetch(layer, chunk, ())
            from_store |= missed
            compute = torch.cuda.current_stream(self.device)
            self.copy_stream.wait_stream(compute)
            with torch.cuda.stream(self.copy_stream):
                for e in chunk:
                    slot, _ = self.cache.admit(ExpertKey(layer, e), pinned)
                    self.data[slot].copy_(ram.arena.tensor(ram_slots[e], self.layout.dtype), non_blocking=True)
                    self.copy_bytes += self.layout.record_bytes
                self.copies_done.record(self.copy_stream)
            self.pending = True
        return from_store

    def wait_copies(self) -> None:
        """The compute stream waits for every copy issued so far (no host wait)."""
        if self.pending:
            torch.cuda.current_stream(self.device).wait_event(self.copies_done)
            self.pending = False

    def slot(self, layer: int, expert: int) -> int:
        s = self.cache.slot_of(ExpertKey(layer, expert))
        assert s is not None, f"layer {layer} expert {expert} is not in a GPU slot"
        return s

"""The GPU tier of the tiered provider: record-sized slots in one device tensor, filled from the RAM
tier by copies on a side stream, so that the compute stream only waits where it reads a slot.

Ordering, in the two directions a slot is shared:
- a copy into a slot is issued after everything already launched on the compute stream (an evicted
  slot may still be read by a kernel in flight): the copy stream waits on the compute stream;
- a kernel reading a slot runs after its copy: the compute stream waits on the copies' event
  (wait_copies), once per layer, not per expert.
The RAM tier's slots feed these copies, so it waits for them (synchronize_copies) before a refill.

The two tiers are exclusive: a record copied into a slot leaves the RAM tier (unless a CPU-lane job holds
it), and a slot's evicted record is written back into the RAM tier (a device-to-host copy on the same
stream, before the slot is overwritten). So the GPU and RAM tiers together hold as many records as they
have slots; a RAM tier that kept what it last fetched would mostly hold the slots' own recent records,
and the slots' victims would come back from the store (measured on the H200, 24 GB budget, 2,149 + 1,820
slots for 3,072 records: 3,544 of the run's 3,671 slot misses were read from the store).

On a CPU device the same tier is a "slot lane" in host memory (copies are plain memcpys, nothing to
order): the lane split of engine.tiers.lanes runs on CPU CI with it, the slot side computed by the
slot kernels under Triton's interpreter or their reference (tests/engine/test_cpu_lane.py).
"""
from __future__ import annotations

import logging
import time

import torch

from engine.experts.layout import ExpertLayout
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
        self.cuda = device.type == "cuda"
        self.cache = ExpertCache("gpu", slots, make_policy(policy))
        # Zeros, not empty: a slot the kernels read under a zero weight (a pick the CPU lane computes) must hold
        # finite values even before the cache first fills it (0 * NaN is NaN).
        self.data = torch.zeros((slots, layout.record_elems), dtype=layout.dtype, device=device)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.copies_done = torch.cuda.Event() if self.cuda else None
        self.pending = False                 # copies issued that the compute stream has not waited for
        self.copy_bytes = 0
        self.copies = 0
        self.writebacks = 0                  # evicted records copied back into the RAM tier
        self.landing: set = set()            # keys whose write-back into RAM may still be in flight (CUDA)
        self._copy_seconds = 0.0
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []    # copy batches not yet timed

    def load(self, layer: int, experts: list[int], ram, pinned: set) -> set[int]:
        """Issue the copies that make each expert of `layer` resident in a GPU slot (does not wait for
        them); the RAM tier fetches from the store what it lacks, in chunks of its capacity. Keys in
        `pinned` are never evicted. → the experts that came from the store."""
        need = [e for e in experts if ExpertKey(layer, e) not in self.cache]
        if not need:                         # the common decode case: every pick already in a slot
            return set()
        self.copy_seconds                    # folds the finished batches' times in: the event list stays short
        from_store: set[int] = set()
        step = max(1, ram.room(()))          # RAM slots a CPU-lane job holds are not for these chunks
        for i in range(0, len(need), step):
            chunk = need[i:i + step]
            # The RAM tier holds only this chunk for its copies (a refill waits for them), so it pins only the
            # chunk: pinning every GPU-pinned key there too could pin all of a small RAM tier.
            ram_slots, missed = ram.fetch(layer, chunk, ())
            from_store |= missed
            if not self.cuda:
                t0 = time.perf_counter()
                self._copy_up(layer, chunk, ram_slots, ram, pinned)
                self._copy_seconds += time.perf_counter() - t0
            else:
                compute = torch.cuda.current_stream(self.device)
                self.copy_stream.wait_stream(compute)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(self.copy_stream):
                    start.record(self.copy_stream)
                    self._copy_up(layer, chunk, ram_slots, ram, pinned)
                    end.record(self.copy_stream)
                    self.copies_done.record(self.copy_stream)
                self._timed.append((start, end))
                self.pending = True
            self.copy_bytes += len(chunk) * self.layout.record_bytes
            self.copies += len(chunk)
        return from_store

    def _copy_up(self, layer: int, chunk: list[int], ram_slots: dict[int, int], ram, pinned: set) -> None:
        """One chunk's copies RAM → GPU slot (on CUDA issued on the copy stream, the caller's context). Each
        slot's evicted record is written back first (it is read before the copy overwrites it) into a RAM slot
        none of the chunk's records not yet copied up holds; each record copied up then leaves RAM, so its
        slot can take a later write-back (issued after this copy, on the same stream) or refill (which waits
        for the copies: synchronize_copies)."""
        waiting = {ExpertKey(layer, e) for e in chunk}
        for e in chunk:
            key = ExpertKey(layer, e)
            slot, evicted = self.cache.admit(key, pinned)
            if evicted is not None and (rslot := ram.slot_for(evicted, waiting)) is not None:
                ram.arena.tensor(rslot, self.layout.dtype).copy_(self.data[slot], non_blocking=self.cuda)
                if self.cuda:
                    self.landing.add(evicted)
                self.writebacks += 1
            self.data[slot].copy_(ram.arena.tensor(ram_slots[e], self.layout.dtype), non_blocking=self.cuda)
            waiting.discard(key)
            ram.release(key)

    def move(self, up: list[tuple[int, torch.Tensor]], down: list[tuple[torch.Tensor, int]], after=None) -> None:
        """Zero-copy decode's promotions (engine.tiers.zero_copy): each (slot, RAM slot tensor) of `up` copied into
        that GPU slot, each (RAM slot tensor, slot) of `down` written back from it, on the copy stream, WITHOUT
        waiting for the compute stream (the caller owns that no kernel in flight reads a destination; `after`, a
        CUDA event, is waited for first where it cannot). Counted and timed as load's copies and write-backs;
        the compute stream waits for them at the next wait_copies."""
        if not self.cuda:
            for slot, src in up:
                self.data[slot].copy_(src)
            for dst, slot in down:
                dst.copy_(self.data[slot])
        else:
            self.copy_seconds                      # folds the finished batches' times in
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.copy_stream):
                if after is not None:
                    self.copy_stream.wait_event(after)
                start.record(self.copy_stream)
                for dst, slot in down:             # read out before anything lands (no slot is both here)
                    dst.copy_(self.data[slot], non_blocking=True)
                for slot, src in up:
                    self.data[slot].copy_(src, non_blocking=True)
                end.record(self.copy_stream)
                self.copies_done.record(self.copy_stream)
            self._timed.append((start, end))
            self.pending = True
        self.copies += len(up)
        self.copy_bytes += len(up) * self.layout.record_bytes
        self.writebacks += len(down)

    @property
    def copy_seconds(self) -> float:
        """Copy-stream busy time of the copies finished so far (CUDA events, read once they are done)."""
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.pop(0)
            self._copy_seconds += start.elapsed_time(end) / 1000
        return self._copy_seconds

    def synchronize_copies(self) -> None:
        """The host waits for every copy issued so far (a RAM slot they read may then be refilled, and the
        RAM slots written back hold their records)."""
        if self.cuda:
            self.copies_done.synchronize()
        self.landing.clear()

    def ready_in_ram(self, keys) -> None:
        """Before the host reads these keys' RAM slots (the CPU lane): wait if a write-back may still be
        filling one of them."""
        if self.landing and not self.landing.isdisjoint(keys):
            self.synchronize_copies()

    def wait_copies(self) -> None:
        """The compute stream waits for every copy issued so far (no host wait)."""
        if self.pending and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copies_done)
            self.pending = False

    def slot(self, layer: int, expert: int) -> int:
        s = self.cache.slot_of(ExpertKey(layer, expert))
        assert s is not None, f"layer {layer} expert {expert} is not in a GPU slot"
        return s

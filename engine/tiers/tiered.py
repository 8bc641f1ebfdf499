"""TieredExperts: an ExpertProvider over GPU slots ← RAM tier ← O_DIRECT store.

The arithmetic is engine.experts.moe_forward (moe_reference's, operation for operation); this class
only decides where each expert's record comes from. Experts are resolved in waves of at most the
compute tier's slot count (in moe_reference's own sorted order), so even a RAM tier of one slot
gives the same result as every expert in memory. Within a wave the experts are pinned (never
evicted), the wave's store misses are read in parallel, and on the CPU its experts are computed in
pairs straight from their RAM slots (one arena, so two slots are one strided batch).
Not thread-safe: one model step calls forward at a time.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine.experts import ExpertLayout, group_routes, moe_forward
from engine.store import manifest as mf
from engine.tiers.cache import ExpertCache, ExpertKey, make_policy
from engine.tiers.gpu import GpuArena
from engine.tiers.ram import RamArena
from engine.tiers.readers import StoreReaders

log = logging.getLogger("engine.tiers")


class TieredExperts:
    def __init__(self, manifest: mf.Manifest, store_dir: str | Path, *, device: str | torch.device = "cpu",
                 ram_slots: int, gpu_slots: int = 0, readers: int = 4, reader_cpus: set[int] | None = None,
                 policy: str = "lru", trace: str | Path | None = None):
        self.manifest = manifest
        self.layout: ExpertLayout = manifest.layout
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        assert ram_slots >= 1, "the RAM tier needs at least one slot"
        assert not self.cuda or gpu_slots >= 1, "a CUDA device needs at least one GPU slot"
        self.ram_cache = ExpertCache("ram", ram_slots, make_policy(policy))
        self.ram = RamArena(ram_slots, self.layout.record_bytes, pin_cuda=self.cuda)
        self.gpu_cache = ExpertCache("gpu", gpu_slots if self.cuda else 0, make_policy(policy))
        self.gpu = GpuArena(gpu_slots, self.layout, self.device) if self.cuda else None
        self.readers = StoreReaders(Path(store_dir) / mf.DATA, readers, reader_cpus)
        # A wave must fit in every tier it passes through.
        self.wave = min(ram_slots, gpu_slots) if self.cuda else ram_slots
        self.served = {"gpu": 0, "ram": 0, "store": 0}
        self._copies_done: torch.cuda.Event | None = None
        self._trace = open(trace, "a") if trace else None

    # -- ExpertProvider -------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        routes = group_routes(topk_ids)               # ascending experts: the order moe_reference visits them in
        picks = {r.expert: len(r.tokens) for r in routes}
        if self._trace:
            self._trace.write(json.dumps({"layer": layer, "experts": list(picks)}) + "\n")

        def resolve(wave: list[int]):
            records = self._resolve(layer, wave, picks)
            return [self.layout.views(records[e]) for e in wave]

        return moe_forward(x, topk_weights, routes, resolve, self.wave)

    def counters(self) -> dict:
        return {
            "served": dict(self.served),
            "store_read_bytes": self.readers.bytes_read,
            "store_reads": self.readers.reads,
            "read_seconds": self.readers.seconds,
            "tiers": {name: {"slots": c.capacity, **c.stats.as_dict()}
                      for name, c in (("gpu", self.gpu_cache), ("ram", self.ram_cache))},
            "policy": self.ram_cache.policy.name,
        }

    # -- tiers ---------------------------------------------------------------------------------
    def _resolve(self, layer: int, wave: list[int], picks: dict[int, int]) -> dict[int, torch.Tensor]:
        """Make every expert of `wave` resident in the compute tier → {expert: flat record tensor}."""
        keys = {e: ExpertKey(layer, e) for e in wave}
        pinned = set(keys.values())
        out: dict[int, torch.Tensor] = {}
        need_ram = []
        for e in wave:
            if self.cuda:
                g = self.gpu_cache.lookup(keys[e])
                if g is not None:
                    out[e] = self.gpu.tensor(g)
                    self.served["gpu"] += picks[e]
                    continue
            need_ram.append(e)

        ram_slot: dict[int, int] = {}
        reads = []
        for e in need_ram:
            r = self.ram_cache.lookup(keys[e])
            if r is not None:
                ram_slot[e] = r
                self.served["ram"] += picks[e]
        for e in need_ram:
            if e not in ram_slot:
                r, _ = self.ram_cache.admit(keys[e], pinned)
                ram_slot[e] = r
                rec = self.manifest.record(layer, e)
                reads.append((rec.offset, self.ram.buffer(r)))
                self.served["store"] += picks[e]
        if reads:
            if self._copies_done is not None:
                self._copies_done.synchronize()   # a RAM slot about to be overwritten may still be feeding a copy
            self.readers.read_batch(reads)

        for e in need_ram:
            src = self.ram.tensor(ram_slot[e], self.layout.dtype)
            if self.cuda:
                g, _ = self.gpu_cache.admit(keys[e], pinned)
                dst = self.gpu.tensor(g)
                dst.copy_(src, non_blocking=self.ram.pinned)
                out[e] = dst
            else:
                out[e] = src
        if self.cuda and need_ram:
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()
        return out

    def close(self) -> None:
        self.readers.close()
        self.ram.close()
        if self._trace:
            self._trace.close()
            self._trace = None

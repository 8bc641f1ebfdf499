"""Expert providers for CUDA devices, computing from slots with engine.kernels.triton_moe.

GpuResidentExperts: every expert in one device arena; slot = layer base + expert id, computed on
  the device, so a decode step never reads back to the host and is CUDA-graph capturable.
GpuOffloadExperts: a capped arena of GPU slots ← a page-locked RAM tier ← the O_DIRECT store.
  One host read of the routing per MoE layer (unavoidable: the host must know what to copy),
  copies on a side stream with events, and layer-ahead prefetch: the next layer's router applied
  to this layer's input predicts its experts, whose copies then overlap this layer's compute.
Both give the same result as engine.experts.moe_reference to bf16 rounding; caching never
changes which expert computes which token.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from engine.experts import ExpertLayout
from engine.kernels.triton_moe import moe_from_slots
from engine.store import manifest as mf
from engine.store.odirect import aligned_buffer, open_direct, pread_full
from engine.tiers.cache import ExpertCache, make_policy
from engine.tiers.ram import RamArena
from engine.tiers.readers import StoreReaders

log = logging.getLogger("engine.gpu")

Predictor = Callable[[int, torch.Tensor], "tuple[int, torch.Tensor] | None"]


def read_layer_records(fd: int, manifest: mf.Manifest, layer: int, buf) -> None:
    """One MoE layer's records (contiguous in the store) into an aligned buffer, O_DIRECT."""
    first = manifest.record(layer, 0).offset
    pread_full(fd, memoryview(buf)[:manifest.experts_per_layer * manifest.record_bytes], first)


class GpuResidentExperts:
    def __init__(self, layout: ExpertLayout, arena: torch.Tensor, bases: dict[int, int]):
        self.layout, self.arena, self.bases = layout, arena, bases
        self.picks = 0

    @classmethod
    def from_store(cls, store_dir: str | Path, device: torch.device) -> "GpuResidentExperts":
        m = mf.load(store_dir)
        mf.check_order(m, device, store_dir)
        e, rec = m.experts_per_layer, m.record_bytes
        arena = torch.empty((len(m.moe_layers) * e, m.layout.record_elems), dtype=m.layout.dtype, device=device)
        staging = aligned_buffer(e * rec)
        host = torch.frombuffer(staging, dtype=torch.uint8)[:e * rec]
        fd = open_direct(Path(store_dir) / mf.DATA)
        try:
            for i, layer in enumerate(m.moe_layers):
                read_layer_records(fd, m, layer, staging)
                arena[i * e:(i + 1) * e].view(torch.uint8).view(-1).copy_(host)
        finally:
            import os
            os.close(fd)
        return cls(m.layout, arena, {layer: i * e for i, layer in enumerate(m.moe_layers)})

    def forward(self, layer, x, topk_ids, topk_weights):
        self.picks += topk_ids.numel()          # a Python int: no device read
        return moe_from_slots(x, self.arena, topk_ids + self.bases[layer], topk_weights, self.layout, topk_ids)

    def counters(self) -> dict:
        return {"served": {"gpu": self.picks, "ram": 0, "store": 0}, "store_read_bytes": 0}


class GpuOffloadExperts:
    def __init__(self, manifest: mf.Manifest, store_dir: str | Path, *, device: torch.device, gpu_slots: int,
                 ram_slots: int, readers: int = 8, reader_cpus: set[int] | None = None, policy: str = "lru"):
        self.m, self.layout = manifest, manifest.layout
        self.device = torch.device(device)
        mf.check_order(manifest, self.device, store_dir)
        n = len(manifest.records)
        self.gpu_cache = ExpertCache("gpu", min(gpu_slots, n), make_policy(policy))
        self.ram_cache = ExpertCache("ram", min(ram_slots, n), make_policy(policy))
        self.arena = torch.empty((self.gpu_cache.capacity, self.layout.record_elems), dtype=self.layout.dtype,
                                 device=self.device)
        self.ram = RamArena(self.ram_cache.capacity, manifest.record_bytes, pin_cuda=True)
        self.readers = StoreReaders(Path(store_dir) / mf.DATA, readers, reader_cpus)
        self.copy_stream = torch.cuda.Stream(self.device)
        self.copies_done = torch.cuda.Event()
        self.pending = False                     # copies issued that the compute stream has not waited for
        self.predictor: Predictor | None = None
        self.override: Callable[[int, torch.Tensor], torch.Tensor] | None = None
        self.origin: dict = {}                   # prefetched key -> tier it came from (for honest counters)
        self.served = {"gpu": 0, "ram": 0, "store": 0}
        self.pcie_bytes = 0
        self.host_seconds = 0.0
        self._slots_host = torch.empty(4096, dtype=torch.int32, pin_memory=True)

    # -- loading -----------------------------------------------------------------------------------
    def _ensure(self, layer: int, experts: list[int], pinned: set) -> None:
        """Issue the copies that make each (layer, e) resident in a GPU slot; does not wait for them.
        `experts` must fit the GPU tier beside `pinned`; RAM staging goes in chunks that fit the RAM tier."""
        need = [e for e in experts if (layer, e) not in self.gpu_cache]
        step = max(1, self.ram_cache.capacity)
        for i in range(0, len(need), step):
            self._load_chunk(layer, need[i:i + step], pinned)

    def _load_chunk(self, layer: int, need: list[int], pinned: set) -> None:
        # Store → RAM for those not in the RAM tier, all reads in flight at once. A RAM slot about to be
        # refilled may still be the source of an earlier H2D copy: wait for those copies first.
        from_store = [e for e in need if self.ram_cache.lookup((layer, e)) is None]
        if from_store:
            self.copies_done.synchronize()
            reqs = []
            for e in from_store:
                slot, _ = self.ram_cache.admit((layer, e), pinned={(layer, x) for x in need})
                reqs.append((self.m.record(layer, e).offset, self.ram.buffer(slot)))
            self.readers.read_batch(reqs)
        # RAM → GPU on the side stream, after every kernel already launched (an evicted slot may be in use).
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for e in need:
                key = (layer, e)
                src = self.ram.tensor(self.ram_cache._slot[key], self.layout.dtype)
                slot, evicted = self.gpu_cache.admit(key, pinned=pinned)
                if evicted is not None:
                    self.origin.pop(evicted, None)
                self.arena[slot].copy_(src, non_blocking=True)
                self.origin[key] = "store" if e in from_store else "ram"
                self.pcie_bytes += self.m.record_bytes
            self.copies_done.record(self.copy_stream)
        self.pending = True

    def _wait_copies(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.device).wait_event(self.copies_done)
            self.pending = False

    def _count(self, layer: int, ids: list[int]) -> None:
        """Where each pick is served from, before anything is loaded (prefetched ones by their origin)."""
        for e in ids:
            key = (layer, e)
            if key in self.origin:
                self.served[self.origin[key]] += 1
            elif key in self.gpu_cache:
                self.served["gpu"] += 1
            elif key in self.ram_cache:
                self.served["ram"] += 1
            else:
                self.served["store"] += 1
        for e in set(ids):
            if self.gpu_cache.lookup((layer, e)) is not None:
                self.origin.pop((layer, e), None)

    # -- ExpertProvider ----------------------------------------------------------------------------
    def forward(self, layer, x, topk_ids, topk_weights):
        if self.override is not None:           # a labelled synthetic routing trace (bench only)
            topk_ids = self.override(layer, topk_ids)
        decode = topk_ids.numel() <= 64
        pred = self.predictor(layer, x) if (self.predictor and decode) else None
        t0 = time.perf_counter()
        flat = topk_ids.reshape(-1)
        both = torch.cat([flat, pred[1].reshape(-1)]) if pred else flat
        host = both.to("cpu").tolist()          # the one device read of this layer
        ids, ahead = host[:flat.numel()], host[flat.numel():]
        uniq = sorted(set(ids))
        self._count(layer, ids)
        cap = self.gpu_cache.capacity
        if len(uniq) <= cap:
            keys = {(layer, e) for e in uniq}
            self._ensure(layer, uniq, pinned=keys)
            self._wait_copies()
            if len(ids) > self._slots_host.numel():         # a long prefill: grow the pinned staging
                self._slots_host = torch.empty(len(ids), dtype=torch.int32, pin_memory=True)
            slots = self._slots_host[:len(ids)]
            slots.copy_(torch.tensor([self.gpu_cache._slot[(layer, e)] for e in ids], dtype=torch.int32))
            slots_dev = slots.to(self.device, non_blocking=True).view_as(topk_ids)
            out = moe_from_slots(x, self.arena, slots_dev, topk_weights, self.layout, topk_ids)
        else:
            out = self._forward_waves(layer, x, topk_ids, topk_weights, uniq, cap)
            keys = set()
        for e in uniq:
            self.origin.pop((layer, e), None)
        if pred:                                # prefetch the next layer while this one computes: best effort
            nxt, want = pred[0], sorted(set(ahead))
            if len(keys) + len(want) <= cap:
                self._ensure(nxt, want, pinned=keys | {(nxt, e) for e in want})
        self.host_seconds += time.perf_counter() - t0
        return out

    def _forward_waves(self, layer, x, topk_ids, topk_weights, uniq, cap):
        """More distinct experts than GPU slots (a long prefill on a small tier): waves of experts in
        ascending order, accumulated exactly as moe_reference does, so results do not depend on `cap`."""
        from engine.experts import expert_ffn
        out = torch.zeros_like(x)
        for i in range(0, len(uniq), cap):
            wave = uniq[i:i + cap]
            self._ensure(layer, wave, pinned={(layer, e) for e in wave})
            self._wait_copies()
            for e in wave:
                tok, k = (topk_ids == e).nonzero(as_tuple=True)
                gate, up, down = self.layout.views(self.arena[self.gpu_cache._slot[(layer, e)]])
                y = expert_ffn(x[tok], gate, up, down)
                out.index_add_(0, tok, y * topk_weights[tok, k, None].to(y.dtype))
        return out

    def counters(self) -> dict:
        return {"served": dict(self.served), "store_read_bytes": self.readers.bytes_read,
                "pcie_bytes": self.pcie_bytes, "host_seconds": round(self.host_seconds, 4),
                "gpu": self.gpu_cache.stats.as_dict(), "ram": self.ram_cache.stats.as_dict(),
                "store_read_seconds": round(self.readers.seconds, 4)}

    def close(self):
        self.readers.close()
        self.ram.close()


def layer_ahead_predictor(model) -> Predictor:
    """Apply the next MoE layer's router to this layer's input (the seed's layer-ahead routing)."""
    from engine.models.common import softmax_topk
    moe = [l for l in range(len(model.layers)) if hasattr(model.layers[l].mlp, "gate")]
    nxt = {a: b for a, b in zip(moe, moe[1:])}

    def predict(layer: int, x: torch.Tensor):
        if layer not in nxt:
            return None
        block = model.layers[nxt[layer]].mlp
        ids, _ = softmax_topk(torch.nn.functional.linear(x, block.gate), block.top_k, False, x.dtype)
        return nxt[layer], ids
    return predict

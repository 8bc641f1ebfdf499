"""TieredExperts: the ExpertProvider over GPU slots ← page-locked RAM tier ← O_DIRECT store.

This class only decides where each expert's record comes from; the arithmetic never depends on it:
- on the CPU the experts are computed straight from their RAM slots (engine.experts.moe_forward,
  moe_reference's arithmetic operation for operation, in waves of at most the RAM tier's slots);
- on a CUDA device they are copied into GPU slots on a side stream (engine.tiers.gpu) and computed
  there: a decode step's few pairs by the slot-indexed GEMV kernels from a slot table, prefill by
  moe_forward in waves of at most the GPU tier's slots, so any tier sizes give the same result.
Decode on CUDA needs one host read of the routing per MoE layer (the host must know what to copy);
with a predictor (layer_ahead_predictor) the next layer's router applied to this layer's input
predicts its experts, whose copies then overlap this layer's compute. That host read is the only
host work, so the rest of a step is CUDA-graph capturable in pieces between the reads: under a
graph Recorder (engine.gpu.graphs) forward hands the host step to the recorder instead of running it.
Not thread-safe: one model step calls forward at a time.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from engine.experts import ExpertLayout, group_routes, moe_forward
from engine.kernels.triton_moe import GEMV_MAX_PAIRS, slot_moe, triton_available
from engine.store import manifest as mf
from engine.tiers.cache import ExpertCache, ExpertKey
from engine.tiers.gpu import GpuTier
from engine.tiers.ram import RamTier

log = logging.getLogger("engine.tiers")

# (layer, x) -> (next MoE layer, its predicted topk_ids) or None
Predictor = Callable[[int, torch.Tensor], "tuple[int, torch.Tensor] | None"]


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
        mf.check_order(manifest, self.device, store_dir)
        self.ram = RamTier(manifest, store_dir, slots=ram_slots, readers=readers, reader_cpus=reader_cpus,
                           policy=policy, pin_cuda=self.cuda)
        self.gpu = GpuTier(gpu_slots, self.layout, self.device, policy) if self.cuda else None
        if self.gpu is not None:
            self.ram.before_refill = self.gpu.copies_done.synchronize   # a RAM slot may still feed a copy
        # A wave of experts must fit every tier it passes through (the GPU tier loads RAM-sized chunks).
        self.wave = self.gpu.cache.capacity if self.cuda else ram_slots
        self.predictor: Predictor | None = None
        self.recorder = None             # a graph Recorder while engine.gpu.graphs captures a decode step
        self.served = {"gpu": 0, "ram": 0, "store": 0}
        self.origin: dict[ExpertKey, str] = {}   # prefetched key -> the tier it came from (honest counters)
        self.host_seconds = 0.0
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # layer -> (pinned, device) slot table
        self._trace = open(trace, "a") if trace else None

    @property
    def readers(self):
        """The store readers (the RAM tier's)."""
        return self.ram.readers

    @property
    def graph_capturable(self) -> bool:
        """A decode step can be captured (in pieces: forward cuts the graph at each routing read)."""
        return self.cuda and triton_available(self.device)

    def graph_pairs_ok(self, pairs: int) -> bool:
        """A captured step's slot table holds every pick of a layer at once: they must fit the GPU tier."""
        return pairs <= min(GEMV_MAX_PAIRS, self.gpu.cache.capacity) if self.gpu is not None else False

    # -- ExpertProvider -------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.gpu is not None and topk_ids.numel() <= GEMV_MAX_PAIRS and self.graph_pairs_ok(topk_ids.numel()) \
                and triton_available(self.device):
            return self._decode_from_slots(layer, x, topk_ids, topk_weights)
        routes = group_routes(topk_ids)               # ascending experts: the order moe_reference visits them in
        picks = {r.expert: len(r.tokens) for r in routes}
        self._record_trace(layer, list(picks))
        resolve = (lambda wave: self._resolve_gpu(layer, wave, picks)) if self.cuda else \
            (lambda wave: self._resolve_ram(layer, wave, picks))
        return moe_forward(x, topk_weights, routes, resolve, self.wave)

    def counters(self) -> dict:
        gpu = self.gpu.cache if self.gpu is not None else ExpertCache("gpu", 0)     # the CPU has no GPU tier
        tiers = {name: {"slots": c.capacity, **c.stats.as_dict()} for name, c in (("gpu", gpu), ("ram", self.ram.cache))}
        return {
            "provider": "tiered",
            "served": dict(self.served),
            "store_read_bytes": self.ram.readers.bytes_read,
            "store_reads": self.ram.readers.reads,
            "read_seconds": round(self.ram.readers.seconds, 4),
            "pcie_bytes": self.gpu.copy_bytes if self.gpu is not None else 0,
            "host_seconds": round(self.host_seconds, 4),
            "tiers": tiers,
            "policy": self.ram.cache.policy.name,
        }

    # -- decode on CUDA: one slot table per layer, the GEMV kernels ---------------------------------
    def _decode_from_slots(self, layer, x, topk_ids, topk_weights):
        n = topk_ids.numel()
        pred = self.predictor(layer, x) if self.predictor else None
        flat = topk_ids.reshape(-1)
        routed = torch.cat([flat, pred[1].reshape(-1)]) if pred else flat
        table = self._table(layer)

        def place():
            self._place(layer, routed, n, pred[0] if pred else None, table)

        if self.recorder is not None:
            self.recorder.cut(place)      # captured: the host step runs between this piece and the next
        else:
            place()
        slots = table[1][:n].view(topk_ids.shape)
        return slot_moe(x, self.gpu.data, slots, topk_weights, self.layout)

    def _table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's slot table: a page-locked host staging row and the device row the kernels read; made
        on the first (eager) step, never during a capture."""
        if layer not in self._tables:
            assert self.recorder is None, "slot tables are made by an eager step before any capture"
            self._tables[layer] = (torch.empty(GEMV_MAX_PAIRS, dtype=torch.int32, pin_memory=True),
                                   torch.empty(GEMV_MAX_PAIRS, dtype=torch.int32, device=self.device))
        return self._tables[layer]

    def _place(self, layer: int, routed: torch.Tensor, n: int, nxt: int | None, table) -> None:
        """The host step of a decode layer: read the routing (and the prediction), copy what is missing
        into GPU slots, fill the slot table, then start the next layer's predicted copies."""
        t0 = time.perf_counter()
        host = routed.tolist()              # the one device read of this layer
        ids, ahead = host[:n], host[n:]
        uniq = sorted(set(ids))
        self._record_trace(layer, uniq)
        self._count(layer, ids)
        keys = {ExpertKey(layer, e) for e in uniq}
        self.gpu.load(layer, uniq, self.ram, keys)
        self.gpu.wait_copies()
        staging, dev = table
        staging[:n] = torch.tensor([self.gpu.slot(layer, e) for e in ids], dtype=torch.int32)
        dev[:n].copy_(staging[:n], non_blocking=True)
        if nxt is not None:                 # prefetch the next layer while this one computes: best effort
            want = sorted(set(ahead))
            if len(keys) + len(want) <= self.gpu.cache.capacity:
                want_keys = {ExpertKey(nxt, e) for e in want}
                missing = [e for e in want if ExpertKey(nxt, e) not in self.gpu.cache]
                from_store = self.gpu.load(nxt, missing, self.ram, keys | want_keys)
                for e in missing:
                    self.origin[ExpertKey(nxt, e)] = "store" if e in from_store else "ram"
        self.host_seconds += time.perf_counter() - t0

    def _count(self, layer: int, ids: list[int]) -> None:
        """Where each pick is served from, before anything is loaded (prefetched ones by their origin)."""
        for e in ids:
            key = ExpertKey(layer, e)
            if key in self.origin and key in self.gpu.cache:
                self.served[self.origin[key]] += 1
            elif key in self.gpu.cache:
                self.served["gpu"] += 1
            elif key in self.ram.cache:
                self.served["ram"] += 1
            else:
                self.served["store"] += 1
        for e in set(ids):
            self.origin.pop(ExpertKey(layer, e), None)
            self.gpu.cache.lookup(ExpertKey(layer, e))       # hit/miss counters and recency of the GPU tier

    # -- prefill on CUDA, and everything on the CPU: moe_forward over waves -----------------------
    def _resolve_gpu(self, layer: int, wave: list[int], picks: dict[int, int]):
        keys = {ExpertKey(layer, e) for e in wave}
        for e in wave:
            key = ExpertKey(layer, e)
            tier = self.origin.pop(key, None) or ("gpu" if self.gpu.cache.lookup(key) is not None else
                                                  "ram" if key in self.ram.cache else "store")
            self.served[tier] += picks[e]
        self.gpu.load(layer, wave, self.ram, keys)
        self.gpu.wait_copies()
        return [self.layout.views(self.gpu.data[self.gpu.slot(layer, e)]) for e in wave]

    def _resolve_ram(self, layer: int, wave: list[int], picks: dict[int, int]):
        slots, from_store = self.ram.fetch(layer, wave, ())
        for e in wave:
            self.served["store" if e in from_store else "ram"] += picks[e]
        return [self.layout.views(self.ram.arena.tensor(slots[e], self.layout.dtype)) for e in wave]

    def _record_trace(self, layer: int, experts: list[int]) -> None:
        if self._trace:
            self._trace.write(json.dumps({"layer": layer, "experts": experts}) + "\n")

    def close(self) -> None:
        self.ram.close()
        if self._trace:
            self._trace.close()
            self._trace = None


def layer_ahead_predictor(model) -> Predictor:
    """Apply the next MoE layer's router to this layer's input (the seed's layer-ahead routing). Reads
    the router weights and top_k of the model's MoE blocks (their `gate` and `top_k`)."""
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

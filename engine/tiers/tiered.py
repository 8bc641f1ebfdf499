"""TieredExperts: the ExpertProvider over GPU slots ← page-locked RAM tier ← O_DIRECT store.

This class only decides where each expert's record comes from and which lane computes it; the arithmetic
never depends on it:
- on the CPU the experts are computed straight from their RAM slots (engine.tiers.waves.moe_forward,
  moe_reference's arithmetic operation for operation, in waves of at most the RAM tier's slots);
- on a CUDA device they are copied into GPU slots on a side stream (engine.tiers.gpu) and computed
  there: a decode step's few pairs by the slot-indexed GEMV kernels from a slot table, prefill in waves of at
  most the GPU tier's slots (quantized records: the grouped GEMM over the slots, the resident provider's kernel;
  others: moe_forward), so any tier sizes give the same result (several waves of quantized records: within
  rounding);
- with the CPU expert lane (cpu_experts auto/on, engine.tiers.lanes) a decode step's picks whose expert
  is in RAM but not in a GPU slot may instead be computed on the CPU, from the RAM slot, while the GPU
  computes the slot picks (their slot-table entries weigh 0 there); the CPU partial sum is copied to the
  device and added. lanes.split chooses per layer from the lane rates; hot experts are promoted to slots.
Where the GPU and RAM tiers hold every record (preloaded), a CUDA decode step reads RAM-tier records in place
instead (engine.tiers.zero_copy): no host step, one graph a step, promotions behind the steps. Otherwise:
decode on CUDA needs one host read of the routing per MoE layer (the host must know what to copy);
with a predictor (engine.models.common.layer_ahead_predictor, handed in by use_predictor) the next layer's router applied to this layer's input
predicts its experts, whose copies then overlap this layer's compute. That host read is the only
host work, so the rest of a step is CUDA-graph capturable in pieces between the reads: under a
graph Recorder (engine.gpu.graphs) forward hands the host step to the recorder instead of running it;
with the CPU lane a second host step after the slot kernels collects the CPU's partial sum.
A CPU device given gpu_slots has the same slot tier in host memory (engine.tiers.gpu): the lane split
runs there as on a GPU, which is how CPU CI tests it.
Not thread-safe: one model step calls forward at a time.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from itertools import groupby
from operator import itemgetter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.engine_config import parse_lane_rates
from engine.errors import EngineError, Exit
from engine.experts.layout import ExpertLayout
from engine.experts.provider import ExpertProvider, Predictor
from engine.tiers.waves import group_routes, moe_forward
from engine.kernels.triton_common import GEMV_MAX_PAIRS, triton_available
from engine.kernels.triton_moe import moe_from_slots
from engine.store import manifest as mf
from engine.tiers.cache import ExpertCache, ExpertKey
from engine.tiers.gpu import GpuTier
from engine.kernels import lane as lane_kernel
from engine.tiers.placement import Planner
from engine.tiers.lanes import Candidate, CpuLane, LaneCounters, LaneRates, lane_rates as rates_of, measure_rates, \
    native_picks, promotions, split
from engine.tiers.ram import RamTier
from engine.tiers.zero_copy import MAX_MOVES, ZeroCopyDecode, blocker as zero_copy_blocker

log = logging.getLogger("engine.tiers")

@dataclass
class LayerTable:
    """One MoE layer's decode staging, made by the first (eager) step and reused by every graph replay:
    the slot of each pick, its lane mask (1: the slot kernels compute it, 0: the CPU lane does), and the
    CPU lane's partial sum; each as a host row (page-locked on CUDA) and the device row the kernels read."""

    slots_host: torch.Tensor
    slots: torch.Tensor
    mask_host: torch.Tensor
    mask: torch.Tensor
    out_host: torch.Tensor
    out: torch.Tensor
    out_zero: bool = False           # out already holds zeros (no CPU job wrote it since)

    def __post_init__(self):
        self.slots_np = self.slots_host.numpy()      # the same memory: a list assigns into it without a tensor


@dataclass
class CpuJob:
    future: object                   # Future of (partial sum [T, H] on the host, busy seconds)
    keys: set                        # RAM keys held until collected
    picks: int
    experts: int


class TieredExperts(ExpertProvider):
    decode_hooks = True              # zero-copy decode's record table, routing log and promotions run between steps
    hands_out_host_records = True    # on a CPU device without a slot tier (host_records says None otherwise)

    def __init__(self, manifest: mf.Manifest, store_dir: str | Path, *, device: str | torch.device = "cpu",
                 ram_slots: int, gpu_slots: int = 0, readers: int = 4, reader_cpus: set[int] | None = None,
                 policy: str = "lru", trace: str | Path | None = None, cpu_experts: str = "off",
                 lane_cpus: set[int] | None = None, lane_rates: str | None = None, placement: str = "auto"):
        self.manifest = manifest
        self.layout: ExpertLayout = manifest.layout
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        assert ram_slots >= 1, "the RAM tier needs at least one slot"
        assert not self.cuda or gpu_slots >= 1, "a CUDA device needs at least one GPU slot"
        mf.check_order(manifest, self.device, store_dir)
        self.ram = RamTier(manifest, store_dir, slots=ram_slots, readers=readers, reader_cpus=reader_cpus,
                           policy=policy, pin_cuda=self.cuda)
        # The slot tier: the GPU's, or on a CPU device given gpu_slots the same tier in host memory.
        self.gpu = GpuTier(gpu_slots, self.layout, self.device, policy) if self.cuda or gpu_slots > 0 else None
        if self.gpu is not None:
            self.ram.before_refill = self.gpu.synchronize_copies   # a RAM slot may still feed a copy
        # A wave of experts must fit every tier it passes through (the GPU tier loads RAM-sized chunks).
        self.wave = self.gpu.cache.capacity if self.gpu is not None else ram_slots
        self.predictor: Predictor | None = None      # use_predictor: the model's layer-ahead routing
        self.served = {"gpu": 0, "ram": 0, "store": 0}
        self.origin: dict[ExpertKey, str] = {}   # prefetched key -> the tier it came from (honest counters)
        self.host_seconds = 0.0
        self._tables: dict[int, LayerTable] = {}
        self._trace = open(trace, "a") if trace else None
        self.lanes = LaneCounters()
        self.heat: Counter = Counter()   # decode picks per ExpertKey (with the CPU lane): which experts a slot should keep
        # The CPU lane needs a slot tier to split against (without one the CPU computes everything anyway).
        self.cpu_experts = cpu_experts if self.gpu is not None and ram_slots >= 2 else "off"
        self.lane: CpuLane | None = None
        self._rates: LaneRates | None = None
        self._measured: dict = {}
        self._job: CpuJob | None = None
        self.zero_copy: ZeroCopyDecode | None = None    # use_zero_copy() turns it on
        # Per layer a static split or a cache, from the measured picks and lane rates (engine.tiers.placement)
        self.planner = Planner(list(manifest.moe_layers), manifest.experts_per_layer, self.layout.record_bytes,
                               mode=placement, gpu_slots=self.gpu.cache.capacity if self.gpu is not None else None)
        self._given_rates_gbps = parse_lane_rates(lane_rates)
        if self.cpu_experts != "off":
            self.lane = CpuLane(lane_cpus)
            self._given_rates = lane_rates
            self._measured = measure_rates(self, lane_rates, ("disk", "pcie"))    # the CPU's at the first decode
            log.info("CPU expert lane: %s on CPUs %s", self.cpu_experts,
                     sorted(self.lane.cpus) if self.lane.cpus else "(unpinned)")

    @property
    def rates(self) -> LaneRates | None:
        """The lane rates the cost model uses (None without a CPU lane); the CPU's measured on first use."""
        if self._rates is None and self.lane is not None:
            self._rates = rates_of(measure_rates(self, self._given_rates, ("cpu",), self._measured))
            log.info("lane rates: %s", self._rates.as_dict())
        return self._rates

    @property
    def tracing(self) -> bool:
        """Routing is being appended to a trace file (record_trace)."""
        return self._trace is not None

    @property
    def readers(self):
        """The store readers (the RAM tier's)."""
        return self.ram.readers

    @property
    def graph_capturable(self) -> bool:
        """A decode step can be captured (zero-copy: whole; else in pieces, cut at each routing read)."""
        return self.cuda and triton_available(self.device)

    @property
    def host_steps(self) -> bool:
        """A decode layer needs the host (reads its routing, or a CPU device computes): all but zero-copy decode."""
        return self.zero_copy is None

    def graph_pairs_ok(self, pairs: int) -> bool:
        """A captured step's slot table holds every pick of a layer at once: they must fit the GPU tier (zero-copy:
        the GEMV kernels, whatever the tier)."""
        if self.zero_copy is not None:
            return pairs <= GEMV_MAX_PAIRS
        return pairs <= min(GEMV_MAX_PAIRS, self.gpu.cache.capacity) if self.gpu is not None else False

    def use_zero_copy(self, mode: str) -> bool:
        """mode auto: decode zero-copy (engine.tiers.zero_copy) where nothing blocks it, else say why in the log;
        on: the same, EngineError naming the blocker; off: never. Called once the tiers are filled (preload).
        → whether it is on."""
        if mode == "off":
            return False
        why = zero_copy_blocker(self)
        if why is not None and self.cpu_experts == "auto" and self._lane_only_blocks_zero_copy():
            # --cpu-experts auto may not switch off a faster path it does not replace: zero-copy decode reads the
            # RAM tier in place at PCIe speed in one graph a step, where the lane measured 0.29 GB/s on the H200
            # and turning zero-copy off halved decode (135 -> 36 tok/s, issue 32). The lane goes instead.
            log.info("CPU expert lane (auto): off, zero-copy decode serves the RAM tier instead")
            self.lane.close()
            self.lane, self.cpu_experts, why = None, "off", None
        if why is not None:
            if mode == "on":
                raise EngineError(f"--zero-copy on: {why}", Exit.USAGE)
            log.info("zero-copy decode: off, %s", why)
            return False
        self.zero_copy = ZeroCopyDecode(self)
        log.info("zero-copy decode: on: %d GPU slots + %d RAM slots hold all %d records; RAM-tier records are "
                 "read in place over PCIe, up to %d promoted a step", self.gpu.cache.capacity,
                 self.ram.cache.capacity, len(self.manifest.records), MAX_MOVES)
        return True

    def _lane_only_blocks_zero_copy(self) -> bool:
        """Whether the CPU lane is all that stands between these tiers and zero-copy decode."""
        lane, self.lane = self.lane, None
        try:
            return lane is not None and zero_copy_blocker(self) is None
        finally:
            self.lane = lane

    def use_predictor(self, predictor: Predictor) -> None:
        """Prefetch the next layer's predicted experts while a layer computes (the CUDA decode from slots)."""
        self.predictor = predictor

    def before_decode(self) -> None:
        """MoEModel.decode_step's hook before a step's launch (zero-copy: the record table catches up)."""
        if self.zero_copy is not None:
            self.zero_copy.before_decode()

    def after_decode_launch(self, pairs: int) -> None:
        """MoEModel.decode_step's hook once a step is launched (zero-copy: routing log, promotions)."""
        if self.zero_copy is not None:
            self.zero_copy.after_launch(pairs)

    def preload(self) -> dict:
        """Fill the tiers from the store before serving: the slot tier with the first records in store order,
        the RAM tier with the next ones (the tiers are exclusive), as many as they hold. Without it a server that
        says it is ready reads each record from the store at its first pick, mid-stream: on the H200 at a 24 GB
        budget (2,149 + 1,820 slots for 3,072 records) every one of a 96-token run's 2,962 store reads was such a
        first touch, and the disk bound the decode (llama.cpp, the peer, reads all its weights at load too).
        Nothing is evicted here; eviction then follows the routing. → what was loaded, for the load log."""
        t0 = time.perf_counter()
        m = self.manifest
        order = [(layer, e) for layer in m.moe_layers for e in range(m.experts_per_layer)]
        on_gpu = min(self.gpu.cache.capacity, len(order)) if self.gpu is not None else 0
        in_ram = min(self.ram.cache.capacity, len(order) - on_gpu)
        reads = self.ram.readers.reads
        pinned: set = set()
        for layer, group in groupby(order[:on_gpu], key=itemgetter(0)):
            experts = [e for _, e in group]
            pinned |= {ExpertKey(layer, e) for e in experts}
            self.gpu.load(layer, experts, self.ram, pinned)
        for layer, group in groupby(order[on_gpu:on_gpu + in_ram], key=itemgetter(0)):
            self.ram.fetch(layer, [e for _, e in group], ())
        if self.gpu is not None:
            self.gpu.synchronize_copies()
        done = {"gpu": on_gpu, "ram": in_ram, "records": len(order), "store_reads": self.ram.readers.reads - reads,
                "seconds": round(time.perf_counter() - t0, 2)}
        log.info("tiers preloaded: %d records into GPU slots, %d into RAM, of %d (%d store reads, %.1f s)",
                 on_gpu, in_ram, len(order), done["store_reads"], done["seconds"])
        return done

    # -- ExpertProvider -------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        keep: set = set()
        if self.zero_copy is not None:
            if topk_ids.numel() <= GEMV_MAX_PAIRS:
                return self.zero_copy.forward(layer, x, topk_ids, topk_weights)
            self.zero_copy.fence_needed = True       # the kernels below read slots by the cache, not the table
            self.zero_copy.sync_policy()             # ... and admit by the eviction policy: it hears of decode's picks
            keep = self.zero_copy.prefill_keep(layer)    # ... but not over decode's hot set
        elif self.gpu is not None and self.graph_pairs_ok(topk_ids.numel()) \
                and (triton_available(self.device) or not self.cuda):
            return self._decode_from_slots(layer, x, topk_ids, topk_weights)
        routes = group_routes(topk_ids)               # ascending experts: the order moe_reference visits them in
        picks = {r.expert: len(r.tokens) for r in routes}
        self.observe(layer, topk_ids)
        self.record_trace(layer, list(picks))
        lane = "gpu" if self.gpu is not None else "cpu"
        self.lanes.add(lane, topk_ids.numel(), len(picks) * self.layout.record_bytes)
        if self.gpu is not None and self.layout.quantized and triton_available(x.device):
            return self._prefill_from_slots(layer, x, topk_ids, topk_weights, picks, keep)
        resolve = (lambda wave: self._resolve_gpu(layer, wave, picks, keep)) if self.gpu is not None else \
            (lambda wave: self._resolve_ram(layer, wave, picks))
        # The kept records' slots are not the waves': each wave's copies fit the rest.
        return moe_forward(x, topk_weights, routes, resolve, self.wave - len(keep), self.swiglu_limit)

    def host_records(self, layer: int, experts: list[int]) -> list[int] | None:
        """One token's picked experts computed on the CPU by the caller (the native decode step,
        engine.kernels.native.MoETail): their records' host addresses, in the given order, resident in RAM
        (misses read from the store), served and counted as forward serves and counts them → None where this
        provider computes the token itself (a slot tier, or a RAM tier smaller than one token's picks)."""
        if self.gpu is not None or len(experts) > self.wave:
            return None
        order = sorted(experts)                        # forward's order: its fetch, trace and counts see the same
        self.observe(layer, experts)
        self.record_trace(layer, order)
        self.lanes.add("cpu", len(order), len(order) * self.layout.record_bytes)
        slots, from_store = self.ram.fetch(layer, order, ())
        for e in order:
            self.served["store" if e in from_store else "ram"] += 1
        return [self.ram.arena.host_address(slots[e]) for e in experts]

    def book_host_records(self, first: int, picks: list[list[int]]) -> None:
        """ExpertProvider.book_host_records: what host_records does layer by layer for picks that are all resident
        (lookups that hit, in layer order; the planner's counts, a plan where one is due after the last MoE layer;
        the trace; the lanes' and tiers' counts), as a few calls for the whole step: host_records' ~30 Python calls
        a layer were ~8 µs of a CPU demo step's layer, ~0.24 ms a token."""
        if self._trace or self.planner.layers != list(range(first, first + len(picks))):
            return super().book_host_records(first, picks)
        self.planner.observe_rows(np.asarray(picks, dtype=np.int64))
        n = sum(len(p) for p in picks)
        if self.planner.due(len(picks[-1])):
            self.replan()
        self.lanes.add("cpu", n, n * self.layout.record_bytes)
        lookup = self.ram.cache.lookup
        for layer, experts in enumerate(picks, first):
            for e in sorted(experts):
                if lookup(ExpertKey(layer, e)) is None:
                    raise AssertionError(f"layer {layer} expert {e} booked as resident is not")
        self.served["ram"] += n

    def host_record_table(self, layers: int, top_k: int) -> torch.Tensor | None:
        """ExpertProvider.host_record_table: the RAM tier's resident records (None with a slot tier, or where a
        token's picks exceed the RAM tier, as host_records). Kept up to date from the RAM cache's changes."""
        if self.gpu is not None or top_k > self.wave:
            return None
        cache = self.ram.cache
        table = getattr(self, "_host_table", None)
        if table is None or table.shape[0] != layers or cache.changes is not self._host_changes:
            if cache.changes is None:               # the set the cache collects its changed keys in (ours)
                cache.changes = set()
            self._host_changes = cache.changes
            table = self._host_table = torch.zeros(layers, self.manifest.experts_per_layer, dtype=torch.int64)
            changed = list(cache.resident())
        else:
            changed = list(cache.changes)
        rows = table.numpy()
        for key in changed:
            slot = cache.slot_of(key)
            rows[key.layer, key.expert] = 0 if slot is None else self.ram.arena.host_address(slot)
        cache.changes.clear()
        return table

    def counters(self) -> dict:
        gpu = self.gpu.cache if self.gpu is not None else ExpertCache("gpu", 0)     # the CPU has no GPU tier
        tiers = {name: {"slots": c.capacity, **c.stats.as_dict()} for name, c in (("gpu", gpu), ("ram", self.ram.cache))}
        lanes = self.lanes.as_dict()
        zc = self.zero_copy.counters() if self.zero_copy is not None else None
        if zc is not None:       # every pick computed on the GPU, from a slot or read in place
            n = zc["picks"]["gpu"] + zc["picks"]["ram"]
            lanes["gpu"] = {"picks": lanes["gpu"]["picks"] + n,
                            "bytes": lanes["gpu"]["bytes"] + n * self.layout.record_bytes, "seconds": 0.0}
        if self.gpu is not None:
            # PCIe: copies into slots, and (zero-copy) records read in place, each pick's read counted
            lanes["pcie"] = {"picks": self.gpu.copies + (zc["picks"]["ram"] if zc else 0),
                             "bytes": self.gpu.copy_bytes + (zc["read_in_place_bytes"] if zc else 0),
                             "seconds": round(self.gpu.copy_seconds, 6)}
        r = self.ram.readers
        lanes["disk"] = {"picks": r.reads, "bytes": r.bytes_read, "seconds": round(r.seconds, 6)}
        return {
            "provider": "tiered",
            "served": dict(self.served),
            "store_read_bytes": r.bytes_read,
            "store_reads": r.reads,
            "read_seconds": round(r.seconds, 4),
            "pcie_bytes": self.gpu.copy_bytes if self.gpu is not None else 0,
            "writebacks": self.gpu.writebacks if self.gpu is not None else 0,
            "writeback_bytes": self.gpu.writebacks * self.layout.record_bytes if self.gpu is not None else 0,
            "host_seconds": round(self.host_seconds + (zc["host_seconds"] if zc else 0.0), 4),
            "tiers": tiers,
            "policy": self.ram.cache.policy.name,
            "cpu_experts": self.cpu_experts,
            "lanes": lanes,
            "lane_rates": self._rates.as_dict() if self._rates is not None else None,
            "zero_copy": zc,
            "placement": self.planner.summary(),
        }

    # -- decode from slots: one slot table per layer, the GEMV kernels; the CPU lane beside them --------
    def _decode_from_slots(self, layer, x, topk_ids, topk_weights):
        n = topk_ids.numel()
        pred = self.predictor(layer, x) if self.predictor else None
        flat = topk_ids.reshape(-1)
        routed = torch.cat([flat, pred[1].reshape(-1)]) if pred else flat
        table = self._table(layer, x)
        lane = self.lane is not None     # fixed for the provider's life: a captured step has one shape

        def place():
            self._place(layer, routed, n, pred[0] if pred else None, table,
                        (x, topk_ids, topk_weights) if lane else None)

        if self.recorder is not None:
            self.recorder.cut(place)      # captured: the host step runs between this piece and the next
        else:
            place()
        slots = table.slots[:n].view(topk_ids.shape)
        weights = topk_weights * table.mask[:n].view(topk_ids.shape) if lane else topk_weights
        y = moe_from_slots(x, self.gpu.data, slots, weights, self.layout, topk_ids, limit=self.swiglu_limit,
                           types=self.manifest.record_types(layer))
        if not lane:
            return y
        t = x.shape[0]
        if self.recorder is not None:
            self.recorder.cut(lambda: self._collect(table, t))   # the CPU's sum lands while the slot kernels run
        else:
            self._collect(table, t)
        return y + table.out[:t]

    def _table(self, layer: int, x: torch.Tensor) -> LayerTable:
        """Layer's staging (LayerTable); made on the first (eager) step, never during a capture."""
        if layer not in self._tables:
            assert self.recorder is None, "slot tables are made by an eager step before any capture"
            pin, dev = self.cuda, self.device
            rows = (GEMV_MAX_PAIRS, x.shape[-1])
            out = torch.zeros(rows, dtype=x.dtype, device=dev)
            self._tables[layer] = LayerTable(
                torch.empty(GEMV_MAX_PAIRS, dtype=torch.int32, pin_memory=pin),
                torch.zeros(GEMV_MAX_PAIRS, dtype=torch.int32, device=dev),
                torch.ones(GEMV_MAX_PAIRS, dtype=x.dtype, pin_memory=pin),
                torch.ones(GEMV_MAX_PAIRS, dtype=x.dtype, device=dev),
                torch.zeros(rows, dtype=x.dtype, pin_memory=pin) if self.cuda else out, out, True)
        return self._tables[layer]

    def _place(self, layer: int, routed: torch.Tensor, n: int, nxt: int | None, table: LayerTable,
               step: tuple | None) -> None:
        """The host step of a decode layer: read the routing (and the prediction); choose each pick's lane
        (step: this layer's (x, topk_ids, topk_weights) where the CPU lane exists); start the CPU lane's job,
        copy what the GPU lacks into its slots, fill the slot table, promote hot CPU-lane experts and start
        the next layer's predicted copies — the store reads, PCIe copies and CPU experts then run at once."""
        t0 = time.perf_counter()
        host = routed.tolist()              # the one device read of this layer
        ids, ahead = host[:n], host[n:]
        uniq = sorted(set(ids))
        self.record_trace(layer, uniq)
        pick_keys = [ExpertKey(layer, e) for e in ids]
        self._count(pick_keys)
        self.observe(layer, ids)
        if self.lane is not None:           # heat only steers the CPU lane's split and promotions
            self.heat.update(pick_keys)
        cpu: list[int] = []
        cands: dict[int, Candidate] = {}
        if step is not None:
            tokens = Counter(ids)
            cands = {e: Candidate(e, tokens[e], self.heat[ExpertKey(layer, e)]) for e in uniq
                     if ExpertKey(layer, e) not in self.gpu.cache}
            in_slots = len(uniq) - len(cands)
            _, cpu = split(list(cands.values()), self.rates, self.layout.record_bytes, self.cpu_experts,
                           self.gpu.cache.capacity - in_slots)
            # The RAM tier holds the CPU lane's records until the job is collected; keep one slot for copies.
            cpu = sorted(cpu[:max(0, self.ram.cache.capacity - 1)])
            if cpu:
                self._start_cpu_job(layer, cpu, step)
        on_cpu = set(cpu)
        gpu_experts = [e for e in uniq if e not in on_cpu]
        keys = {ExpertKey(layer, e) for e in gpu_experts}
        # The CPU lane's store reads came first, so its job starts before these: the copies' reads and
        # PCIe transfers then overlap the CPU experts.
        self.gpu.load(layer, gpu_experts, self.ram, keys)
        self.gpu.wait_copies()
        # A CPU-lane pick's entry points at a slot the kernels read under weight 0: one this layer keeps (with
        # no slot filled yet, slot 0's zeros; a copy landing there meanwhile holds finite values too).
        dummy = next(iter(keys), None) or next(iter(self.gpu.cache.resident()), None)
        if dummy is not None:
            keys = keys | {dummy}
        dummy_slot = self.gpu.cache.slot_of(dummy) if dummy is not None else 0
        slot_of = self.gpu.cache.slot_of
        table.slots_np[:n] = [dummy_slot if e in on_cpu else slot_of(k) for e, k in zip(ids, pick_keys)]
        table.slots.copy_(table.slots_host, non_blocking=True)      # the whole row: slicing costs more than 256 B
        self.lanes.add("gpu", n - sum(e in on_cpu for e in ids) if on_cpu else n, len(gpu_experts) * self.layout.record_bytes)
        if step is not None:
            table.mask_host[:n] = torch.tensor([0.0 if e in on_cpu else 1.0 for e in ids])
            table.mask[:n].copy_(table.mask_host[:n], non_blocking=True)
            if cpu and dummy is not None:
                self._promote(layer, [cands[e] for e in cpu], len(gpu_experts) - (len(uniq) - len(cands)), keys)
        if nxt is not None:                 # prefetch the next layer while this one computes: best effort
            want = {ExpertKey(nxt, e) for e in ahead}
            missing = sorted(k.expert for k in want if k not in self.gpu.cache)
            if missing and len(keys) + len(want) <= self.gpu.cache.capacity:
                from_store = self.gpu.load(nxt, missing, self.ram, keys | want)
                for e in missing:
                    self.origin[ExpertKey(nxt, e)] = "store" if e in from_store else "ram"
        self.host_seconds += time.perf_counter() - t0

    def _start_cpu_job(self, layer: int, experts: list[int], step: tuple) -> None:
        """Fetch the CPU lane's experts into RAM (reading the store for those it lacks), hold them there, and
        hand the lane their partial sum over just these experts, in expert order: one native call for 4-bit
        records (engine.kernels.lane.moe, fp32), else moe_forward."""
        x, topk_ids, topk_weights = step
        ram_slots, _ = self.ram.fetch(layer, experts, ())
        keys = {ExpertKey(layer, e) for e in experts}
        if self.gpu is not None:
            self.gpu.ready_in_ram(keys)           # a record the GPU tier just wrote back may still be landing
        self.ram.held |= keys
        on_cpu = set(experts)
        host = "cpu"
        xs, ids, ws = x.to(host), topk_ids.to(host), topk_weights.to(host)
        routes = [r for r in group_routes(ids) if r.expert in on_cpu]
        # 4-bit records: the layer's picks in one native call, the GIL released (a SwiGLU limit, glm5_next's, too)
        args = native_picks(self.layout, xs, ws, routes, lambda e: self.ram.arena.host_address(ram_slots[e]))
        if args is not None:
            fut = self.lane.submit(lane_kernel.moe, *args, self.lane.team, None, self.swiglu_limit)
        else:
            views = [self.layout.views(self.ram.arena.tensor(ram_slots[e], self.layout.dtype)) for e in experts]
            fut = self.lane.submit(moe_forward, xs, ws, routes, lambda wave: views, len(experts), self.swiglu_limit)
        self._job = CpuJob(fut, keys, sum(len(r.tokens) for r in routes), len(experts))

    def _collect(self, table: LayerTable, t: int) -> None:
        """The second host step of a decode layer: the CPU lane's partial sum into table.out (zeros when the
        lane had no pick this layer), copied to the device while the slot kernels run."""
        job, self._job = self._job, None
        if job is None:
            if not table.out_zero:
                table.out.zero_()
                table.out_zero = True
            return
        try:
            y, seconds = job.future.result()
        finally:
            self.ram.held -= job.keys
        table.out_host[:t].copy_(y)
        if table.out_host is not table.out:
            table.out[:t].copy_(table.out_host[:t], non_blocking=True)
        table.out_zero = False
        self.lanes.add("cpu", job.picks, job.experts * self.layout.record_bytes, seconds)

    def _promote(self, layer: int, cpu: list[Candidate], copies: int, pinned: set) -> None:
        """Copy the CPU lane's hottest experts into GPU slots too, for their next picks (lanes.promotions: as
        many as the PCIe lane copies while the CPU computes), each only while it is hotter than the slot it
        would take. Not waited for here: the next layer's wait_copies covers them."""
        if not self.planner.promotes(layer):
            return                           # a static layer's residents stay as they are (tiers.placement)
        cache = self.gpu.cache
        for e in promotions(cpu, self.rates, self.layout.record_bytes, copies, None, cache.capacity - len(pinned)):
            key = ExpertKey(layer, e)
            if len(cache) >= cache.capacity:
                try:
                    victim = cache.policy.victim(pinned)
                except LookupError:
                    return
                if self.heat[victim] >= self.heat[key]:
                    return                   # the rest are no hotter (promotions orders them hottest first)
            self.gpu.load(layer, [e], self.ram, pinned | {key})
            self.planner.note_promotion(layer)
            pinned = pinned | {key}

    def _count(self, keys: list[ExpertKey]) -> None:
        """Where each pick is served from, before anything is loaded (prefetched ones by their origin)."""
        gpu, ram, origin, served = self.gpu.cache, self.ram.cache, self.origin, self.served
        for key in keys:
            if key in gpu:
                served[origin.get(key, "gpu")] += 1
            elif key in ram:
                served["ram"] += 1
            else:
                served["store"] += 1
        for key in set(keys):
            origin.pop(key, None)
            gpu.lookup(key)             # hit/miss counters and recency of the GPU tier

    # -- prefill on CUDA, and everything on the CPU: moe_forward over waves -----------------------
    def _resolve_gpu(self, layer: int, wave: list[int], picks: dict[int, int], keep: set = frozenset()):
        self._load_wave(layer, wave, picks, keep)
        return [self.layout.views(self.gpu.data[self.gpu.slot(layer, e)]) for e in wave]

    def _load_wave(self, layer: int, wave: list[int], picks: dict[int, int], keep: set) -> None:
        """A wave of the layer's experts into GPU slots (counted where each came from), `keep` left in place; the
        compute stream waits for the copies."""
        keys = {ExpertKey(layer, e) for e in wave}
        for e in wave:
            key = ExpertKey(layer, e)
            tier = self.origin.pop(key, None) or ("gpu" if self.gpu.cache.lookup(key) is not None else
                                                  "ram" if key in self.ram.cache else "store")
            self.served[tier] += picks[e]
        self.gpu.load(layer, wave, self.ram, keys | keep)
        self.gpu.wait_copies()

    def _prefill_from_slots(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            picks: dict[int, int], keep: set) -> torch.Tensor:
        """Quantized records, many tokens: the layer's picked experts into GPU slots in as few waves as the slots
        allow (the ones resident already first), each wave computed by the grouped GEMM over the slots the resident
        provider's prefill runs (engine.kernels.quant_triton), its other picks weighted 0. moe_forward's per-expert
        path dequantized each record with torch ops first: ~3 s for an 8k prompt at any budget (2,100-2,700 tok/s on
        the H200 and an H100, bench/README). One wave: the resident provider's arithmetic; several: their sums."""
        cache, cap = self.gpu.cache, self.gpu.cache.capacity
        experts = sorted(picks)
        here = [e for e in experts if ExpertKey(layer, e) in cache]
        rest = [e for e in experts if ExpertKey(layer, e) not in cache]
        held = keep | {ExpertKey(layer, e) for e in here}
        first = max(0, cap - len(held))               # slots the first wave's copies may take
        waves = [here + rest[:first]]
        room = max(1, cap - len(keep))
        waves = [w for w in waves + [rest[i:i + room] for i in range(first, len(rest), room)] if w]
        n = self.manifest.experts_per_layer
        types = self.manifest.record_types(layer)
        out = None
        for wave in waves:
            self._load_wave(layer, wave, picks, keep)
            # Picks outside the wave read one of its records (finite weights) and weigh 0.
            slot_of = torch.full((n,), self.gpu.slot(layer, wave[0]), dtype=torch.int32)
            slot_of[wave] = torch.tensor([self.gpu.slot(layer, e) for e in wave], dtype=torch.int32)
            slots = slot_of.to(x.device)[topk_ids]
            if len(waves) == 1:
                return moe_from_slots(x, self.gpu.data, slots, topk_weights, self.layout, limit=self.swiglu_limit,
                                      types=types)
            member = torch.zeros(n, dtype=torch.bool)
            member[wave] = True
            w = topk_weights * member.to(x.device)[topk_ids].to(topk_weights.dtype)
            y = moe_from_slots(x, self.gpu.data, slots, w, self.layout, limit=self.swiglu_limit, types=types)
            out = y if out is None else out + y
        return out

    def _resolve_ram(self, layer: int, wave: list[int], picks: dict[int, int]):
        slots, from_store = self.ram.fetch(layer, wave, ())
        for e in wave:
            self.served["store" if e in from_store else "ram"] += picks[e]
        return [self.layout.views(self.ram.arena.tensor(slots[e], self.layout.dtype)) for e in wave]

    # -- placement from routing statistics (engine.tiers.placement) ---------------------------------------
    def observe(self, layer: int, experts) -> None:
        """A call's picks of a layer (a tensor or list of expert ids) into the planner; the last MoE layer's
        count the window (every layer has seen the call by then), and a plan is made when one is due."""
        ids = experts.reshape(-1).tolist() if isinstance(experts, torch.Tensor) else experts
        self.planner.observe(layer, ids)
        if layer == self.planner.layers[-1] and self.planner.due(len(ids)):
            self.replan()

    def placement_rates(self) -> dict:
        """GB/s of the lanes a miss can take: PCIe (given, the lane model's, or the copies measured so far) and
        the CPU lane (0 without one)."""
        given = self._given_rates_gbps
        r = self._rates.as_dict() if self._rates is not None else {}
        pcie = given.get("pcie") or r.get("pcie_gbps") or 0.0
        if not pcie and self.gpu is not None and self.gpu.copy_seconds > 0:
            pcie = self.gpu.copy_bytes / self.gpu.copy_seconds / 1e9
        cpu = (given.get("cpu") or r.get("cpu_gbps") or 0.0) if self.lane is not None else 0.0
        return {"pcie": pcie, "cpu": cpu}

    def replan(self) -> list[int]:
        """Re-plan every layer now (engine.tiers.placement.Planner.plan) → the layers that changed."""
        on_gpu = Counter(k.layer for k in self.gpu.cache.resident()) if self.gpu is not None else Counter()
        return self.planner.plan(lambda layer: on_gpu[layer], self.placement_rates())

    def record_trace(self, layer: int, experts: list[int]) -> None:
        if self._trace:
            self._trace.write(json.dumps({"layer": layer, "experts": experts}) + "\n")

    def close(self) -> None:
        if self._job is not None:        # a step that failed between its two host steps
            self._job.future.result()
            self._job = None
        if self.lane is not None:
            self.lane.close()
        self.ram.close()
        if self._trace:
            self._trace.close()
            self._trace = None


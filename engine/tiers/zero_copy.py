"""Zero-copy decode: a tiered provider's decode step reads each expert record where it lies — in a GPU slot, or
in its page-locked RAM-tier slot, read in place by the slot kernels over PCIe — so the step has no host step
and is captured as ONE CUDA graph, as the resident provider's is.

Why: the piecewise decode (TieredExperts._place) stops the GPU at every MoE layer while the host reads the
layer's routing, issues the copies it lacks and fills a slot table. With the disk out of the way that host step
bound the H200's decode at a 24 GB budget (166 tok/s served against 515 resident, 0.17 ms a layer; bench/README).
A record not in a GPU slot crosses PCIe once per pick either way (copied, then read; or read in place), and read
in place it needs nobody to decide anything before the kernel runs.

What it needs (blocker() says which is missing): every record in the GPU or the RAM tier (the tiers are exclusive:
gpu_slots + ram_slots must exceed the store's records, and the tiers be preloaded), a RAM arena the GPU can
address (cudaHostRegister'ed; RamArena.device_address), the slot kernels (Triton) and no CPU expert lane.

How the tiers still follow the routing, without the compute stream ever waiting for the host:
- the record table: an int64 per (MoE layer, expert), its record's element offset from the GPU arena's start —
  a GPU slot, or a RAM slot's device address. The kernels read table[layer base + expert]
  (engine.kernels.triton_common.record_ptr). The host keeps a mirror, updated from the tiers' caches (ExpertCache
  .changes), and copies it to the device between steps, behind any copy it depends on.
- the routing log: the gate/up kernel writes each pick's expert id into a device row per MoE layer; after each
  step's launch the host queues that log's copy to page-locked memory, and reads it one step later — as arrays
  (the host work of a step is ~0.1 ms: it is the server's too, under the GIL), noting each record's last use; the
  GPU tier's eviction policy hears of those uses only when it must choose (on the other path, below).
- promotions, by frequency: the GPU slots should hold the hot set, the records the planner's windowed pick counts
  (engine.tiers.placement) rank highest among the cache layers' (a static layer's residents stay). A resident
  ranks as if picked 3 standard deviations more often than it was, so a record displaces it only when it is
  measurably hotter, not by a sample's noise. After each launch, experts the last step read from RAM that belong
  to the hot set are copied into free GPU slots, the hottest first, up to a budget (half of a step's time at the
  measured copy rate); residents outside it are written back to free RAM slots, the coldest first, as many as
  hot records wait — on the copy stream, while the GPU computes. The table update follows those copies on the
  compute stream, so the next step reads the new places. A slot whose record moved away is freed only after the
  step that could still read it has finished (an event recorded behind the table update): no copy lands under
  a running kernel. Why not recency: under a calibrated skew (11.4 % of experts taking 39 % of picks) promoting
  whatever a step read, evicting the least recently used, kept the tail cycling through the slots: 16 promotions a
  step, and the slots served 37.5 % of picks where the hottest records would serve 56 % (bench/placement_sim.py).
Prefill and batches of more picks than the GEMV kernels take go TieredExperts' other path (copies into slots, then
the grouped GEMM over them for quantized records, per-expert GEMMs otherwise), in waves through the slots the hot
set leaves (prefill_keep); the tiers' caches record what that moves and the table follows it before the next step.
The result never depends on where a record was read from (tests/engine/test_zero_copy.py).
"""
from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np
import torch

from engine.kernels.triton_common import GEMV_MAX_PAIRS, triton_available
from engine.kernels.triton_moe import moe_from_slots, read_record
from engine.tiers.cache import ExpertKey

log = logging.getLogger("engine.tiers")

MAX_MOVES = 16            # promotions a step at most (each also frees a GPU slot for the next: a write-back)
COPY_SHARE = 0.5          # of a step's time the promotions' copies may take on the PCIe lane
HOT_Z = 3.0               # standard deviations of its count a resident is credited with (the hot set's hysteresis)
HOT_EVERY = 8             # steps between recomputations of the hot set (its counts move slowly)
# The int4/int8 decode GEMVs' tiles when most records are read over PCIe: 16 groups a load and 4 warps read in place
# at 43 GB/s on the H200 where HBM's best (64 groups, 2 warps) reads 37 (bench/pcie_reads.py, 2026-12-06).
IN_PLACE_GEMV = {"max_span": 16, "warps": 4}
PREFILL_ROOM = 0.25       # of the GPU slots a prefill's waves may use when the hot set would fill them


def blocker(provider) -> str | None:
    """Why `provider` (a TieredExperts) cannot decode zero-copy, or None when it can."""
    gpu, ram, m = provider.gpu, provider.ram, provider.manifest
    if gpu is None:
        return "there is no slot tier (a CUDA device's GPU slots)"
    if provider.lane is not None:
        return "the CPU expert lane is on (--cpu-experts): it computes RAM-tier experts on the CPU instead"
    if not triton_available(provider.device):
        return f"the slot kernels (Triton) do not run on {provider.device}"
    n = len(m.records)
    if gpu.cache.capacity + ram.cache.capacity <= n:
        return (f"the GPU and RAM tiers hold {gpu.cache.capacity} + {ram.cache.capacity} records, not more than "
                f"the store's {n}")
    absent = sum(1 for layer in m.moe_layers for e in range(m.experts_per_layer)
                 if ExpertKey(layer, e) not in gpu.cache and ExpertKey(layer, e) not in ram.cache)
    if absent:
        return f"{absent} of {n} records are in neither tier (they are loaded at start with --preload)"
    if provider.cuda and ram.arena.device_address(0) is None:
        return "the RAM tier's page-locked memory has no device address (cudaHostGetDevicePointer is unreachable)"
    return None


class ZeroCopyDecode:
    """The record table, routing log and promotions of one TieredExperts (see the module docstring)."""

    def __init__(self, provider):
        self.p, self.gpu, self.ram, self.layout = provider, provider.gpu, provider.ram, provider.layout
        m = provider.manifest
        self.cuda, dev = provider.cuda, provider.device
        self.rows = {layer: i for i, layer in enumerate(m.moe_layers)}
        self.experts = m.experts_per_layer
        self.keys = [ExpertKey(layer, e) for layer in m.moe_layers for e in range(self.experts)]
        self.room = self.gpu.cache.capacity + self.ram.cache.capacity - len(self.keys)   # slots beyond the records
        item = self.layout.itemsize
        base = self.gpu.data.data_ptr()
        # Every RAM slot's offset from the GPU arena, in elements (4 KiB-aligned records: exact).
        addr = self.ram.arena.device_address if self.cuda else self.ram.arena.host_address
        self.ram_offsets = []
        for r in range(self.ram.cache.capacity):
            d = addr(r) - base
            assert d % item == 0, "a RAM slot's address is not a whole number of elements from the GPU arena"
            self.ram_offsets.append(d // item)
        self.rec_elems = self.layout.record_elems
        n = len(self.keys)
        self.mirror = torch.zeros(n, dtype=torch.int64)
        self.mirror_np = self.mirror.numpy()                 # the same memory
        self.row_base = (np.arange(len(self.rows), dtype=np.int64) * self.experts)[:, None]
        self.gpu_span = self.gpu.cache.capacity * self.rec_elems     # offsets below it are GPU slots
        self._step = 0
        self.last_use = np.zeros(n, dtype=np.int64)          # the logged step that last picked each record
        self.uses_since = np.zeros(n, dtype=np.int64)        # its picks since the eviction policy last heard
        self.table = torch.zeros(n, dtype=torch.int64, device=dev)
        self.log = torch.full((len(self.rows), GEMV_MAX_PAIRS), -1, dtype=torch.int32, device=dev)
        self._ring = [torch.empty(self.log.shape, dtype=torch.int32, pin_memory=self.cuda) for _ in range(2)]
        self._ring_pairs: list[int | None] = [None, None]
        self._ring_events: list = [None, None]
        self._turn = 0
        self.promoting: set = set()        # copied up; their RAM slot is freed once no step reads it there
        self.demoting: set = set()         # written back; their GPU slot likewise
        self._unsynced: list[tuple[str, ExpertKey]] = []
        self._held: list[tuple[object, str, ExpertKey]] = []     # (event of the table update, "up"/"down", key)
        # Set by TieredExperts' other path (prefill, large batches): kernels that read GPU slots by the cache, not
        # the table, may still run when a slot is released; the next promotions wait for them (fence()).
        self.fence_needed = False
        self._hot: np.ndarray | None = None     # hot_set(), recomputed every HOT_EVERY steps
        self._hot_step = 0
        self._keep: set | None = None           # prefill_keep()'s, for the rest of a pass's layers
        self._last_launch: float | None = None
        self.step_seconds = 0.0            # running mean of the time between two launches (the budget's clock)
        self.picks = {"gpu": 0, "ram": 0}
        self.read_in_place_bytes = 0
        self.promotions = self.demotions = 0
        self.host_seconds = 0.0
        for c in (self.gpu.cache, self.ram.cache):
            c.changes = set()
        for i, key in enumerate(self.keys):
            self.mirror[i] = self._offset(key)
        self.table.copy_(self.mirror)
        if self.cuda:
            self._check_reads_in_place()

    # -- where each record is ---------------------------------------------------------------------------
    def _index(self, key: ExpertKey) -> int:
        return self.rows[key.layer] * self.experts + key.expert

    def _offset(self, key: ExpertKey) -> int:
        """The record's element offset from the GPU arena: its GPU slot unless it is on its way to RAM."""
        s = self.gpu.cache.slot_of(key)
        if s is not None and key not in self.demoting:
            return s * self.rec_elems
        r = self.ram.cache.slot_of(key)
        if r is None:
            raise RuntimeError(f"zero-copy decode: layer {key.layer} expert {key.expert} is in neither tier")
        return self.ram_offsets[r]

    def _check_reads_in_place(self) -> None:
        """A kernel reading a RAM-tier record in place sees its bytes (the device address is right)."""
        key = next((k for k in self.keys if self.gpu.cache.slot_of(k) is None), None)
        if key is None:
            return
        r = self.ram.cache.slot_of(key)
        n = min(self.rec_elems, 4096)
        got = read_record(self.gpu.data, self.ram_offsets[r], n).cpu()
        want = self.ram.arena.tensor(r, self.layout.dtype)[:n]
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            raise RuntimeError("zero-copy decode: a kernel reading the RAM tier in place saw other bytes")

    def sync(self) -> None:
        """Bring the device table to the tiers' state: the mirror's changed entries, then (CUDA) the compute
        stream waits for the copies issued so far and copies the mirror in; slots moved away since the last
        sync are held until that update has passed."""
        changed = self.gpu.cache.changes | self.ram.cache.changes
        if not changed and not self._unsynced:
            return
        self.gpu.cache.changes.clear()
        self.ram.cache.changes.clear()
        for key in changed:
            self.mirror[self._index(key)] = self._offset(key)
        if self.cuda:
            self.gpu.wait_copies()
            # Pageable source: CUDA stages it before returning, so the mirror may change right after.
            self.table.copy_(self.mirror, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.p.device))
        else:
            self.table.copy_(self.mirror)
            done = None
        self._held += [(done, kind, key) for kind, key in self._unsynced]
        self._unsynced = []

    def _release(self) -> None:
        """Free the slots records moved away from, where the step that could read them there has finished."""
        keep = []
        for done, kind, key in self._held:
            if done is not None and not done.query():
                keep.append((done, kind, key))
            elif kind == "up":
                self.promoting.discard(key)
                if key in self.gpu.cache:          # (unless a prefill evicted it back meanwhile)
                    self.ram.cache.discard(key)
            else:
                self.demoting.discard(key)
                if key in self.ram.cache:
                    self.gpu.cache.discard(key)
        self._held = keep

    # -- the decode step --------------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        row = self.rows[layer]
        return moe_from_slots(x, self.gpu.data, topk_ids, topk_weights, self.layout, topk_ids,
                              slot_offset=row * self.experts, table=self.table, log=self.log[row],
                              limit=self.p.swiglu_limit, types=self.p.manifest.record_types(layer), gemv=IN_PLACE_GEMV)

    def before_decode(self) -> None:
        """Before a step's launch: what a prefill moved reaches the table (usually nothing to do)."""
        self._release()
        self.sync()

    def after_launch(self, pairs: int) -> None:
        """After a step's launch, while the GPU computes it: queue its routing log's copy, read the previous
        step's, promote what it read from RAM, and queue the table update behind those copies."""
        t0 = time.perf_counter()
        if self._last_launch is not None:
            gap = min(t0 - self._last_launch, 0.1)       # an idle server's gap is not a step
            self.step_seconds = gap if not self.step_seconds else 0.9 * self.step_seconds + 0.1 * gap
        self._last_launch = t0
        self._release()
        i, self._turn = self._turn, self._turn ^ 1
        step = self._read_log(i ^ 1)
        if pairs <= GEMV_MAX_PAIRS:
            self._ring[i].copy_(self.log, non_blocking=self.cuda)
            if self.cuda:
                self._ring_events[i] = torch.cuda.Event()
                self._ring_events[i].record(torch.cuda.current_stream(self.p.device))
            self._ring_pairs[i] = pairs
        if step is not None:
            self._promote(*step)
            self.sync()
        self.host_seconds += time.perf_counter() - t0

    def _fence(self):
        """An event behind everything queued on the compute stream, if the other path ran since the last one."""
        if not (self.fence_needed and self.cuda):
            return None
        self.fence_needed = False
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.p.device))
        return done

    def _read_log(self, i: int):
        """The routing a logged step read → (its picks' record indices, the RAM-tier ones' keys with how often);
        counters, each record's last use."""
        pairs, self._ring_pairs[i] = self._ring_pairs[i], None
        if pairs is None:
            return None
        if self._ring_events[i] is not None:
            self._ring_events[i].synchronize()           # done already: the step's logits were read
        ids = self._ring[i][:, :pairs].numpy()
        idx = (self.row_base + ids).ravel()
        loc = self.mirror_np[idx]
        in_ram = (loc < 0) | (loc >= self.gpu_span)      # where the table sent this step's kernels
        self._step += 1
        self.last_use[idx] = self._step
        np.add.at(self.uses_since, idx, 1)
        planner = self.p.planner
        planner.observe_rows(ids)
        if planner.due(ids.shape[1]):
            self.p.replan()
        if self.p.tracing:
            for layer, row in self.rows.items():
                self.p.record_trace(layer, sorted(set(ids[row].tolist())))
        n, n_ram = idx.size, int(in_ram.sum())
        from_ram = Counter(self.keys[j] for j in idx[in_ram].tolist()) if n_ram else Counter()
        stats = self.gpu.cache.stats
        stats.hits += n - n_ram
        stats.misses += n_ram
        self.picks["gpu"] += n - n_ram
        self.picks["ram"] += n_ram
        self.read_in_place_bytes += n_ram * self.layout.record_bytes
        self.p.served["gpu"] += n - n_ram
        self.p.served["ram"] += n_ram
        return idx, from_ram

    def sync_policy(self) -> None:
        """Tell the GPU tier's eviction policy of the picks since it last heard, in the order of their last use
        (LFU: each pick): before it chooses a victim — a write-back here, or an admit on the other path."""
        touched = np.flatnonzero(self.uses_since)
        if touched.size == 0:
            return
        cache = self.gpu.cache
        lfu = cache.policy.name == "lfu"
        for j in touched[np.argsort(self.last_use[touched], kind="stable")].tolist():
            key = self.keys[j]
            if key in cache and key not in self.demoting:
                for _ in range(int(self.uses_since[j]) if lfu else 1):
                    cache.policy.access(key)
        self.uses_since[touched] = 0

    def budget(self) -> int:
        """Promotions a step: those whose copies take COPY_SHARE of a step at the copy rate measured so far."""
        rate = self.gpu.copy_bytes / self.gpu.copy_seconds if self.gpu.copy_seconds > 0 else 0.0
        if not rate or not self.step_seconds:
            return 1
        return max(1, min(MAX_MOVES, int(COPY_SHARE * self.step_seconds * rate / self.layout.record_bytes)))

    def hot_set(self) -> np.ndarray:
        """Which records the GPU slots should hold (a bool per record, self.keys' order): every static layer's
        resident, and of the cache layers' records the highest ranked by the planner's windowed pick counts, a
        resident (or one on its way up) credited with HOT_Z standard deviations of its count, as many as the
        slots the static layers leave."""
        planner = self.p.planner
        counts = planner.counts.ravel()                 # planner rows are the MoE layers in manifest order: ours
        resident = np.zeros(len(self.keys), dtype=bool)
        for key in self.gpu.cache.resident():
            if key not in self.demoting:
                resident[self._index(key)] = True
        for key in self.promoting:
            resident[self._index(key)] = True
        static = np.zeros(len(self.keys), dtype=bool)
        for layer in planner.static_layers:
            r = self.rows[layer] * self.experts
            static[r:r + self.experts] = True
        hot = resident & static
        room = self.gpu.cache.capacity - int(hot.sum())
        cand = np.flatnonzero(~static)
        if room > 0 and cand.size:
            rank = counts[cand] + np.where(resident[cand], HOT_Z * np.sqrt(counts[cand] + 1.0), 0.0)
            take = cand if cand.size <= room else cand[np.argpartition(-rank, room - 1)[:room]]
            hot[take] = True
        return hot

    def prefill_keep(self, layer: int) -> set:
        """The GPU-resident records a prefill's waves (TieredExperts' other path) must leave in their slots: the
        hot set's, the hottest first, all but PREFILL_ROOM of the slots at most (the waves' room). Without it an
        8k prompt streams every expert of every layer through the slots and decode starts from whatever the last
        waves left (bench/placement_sim.py: the next 32 steps' picks served from slots 0.349 with neither the hot
        set nor this, 0.529 with both).
        Chosen at a pass's first MoE layer and kept for its others (the waves never evict it meanwhile): a few ms
        of Python a layer for a large model's thousands of slots."""
        if layer != self.p.manifest.moe_layers[0] and self._keep is not None:
            return self._keep
        self._keep = self._prefill_keep()
        return self._keep

    def _prefill_keep(self) -> set:
        hot = self.hot_set()
        counts = self.p.planner.counts.ravel()
        static = self.p.planner.static_layers
        kept = [k for k in self.gpu.cache.resident() if k not in self.demoting and hot[self._index(k)]]
        most = self.gpu.cache.capacity - max(1, int(self.gpu.cache.capacity * PREFILL_ROOM))
        if len(kept) > most:
            kept.sort(key=lambda k: (k.layer not in static, -counts[self._index(k)]))
            kept = kept[:most]
        return set(kept)

    def _promote(self, picked: np.ndarray, from_ram: Counter) -> None:
        budget = self.budget()
        moves = self.room - 1 - len(self.promoting) - len(self.demoting)   # a write-back always finds a RAM slot
        if self._hot is None or self._step - self._hot_step >= HOT_EVERY:
            self._hot, self._hot_step = self.hot_set(), self._step
        hot, counts = self._hot, self.p.planner.counts.ravel()
        up, down = [], []
        # Nothing to rank while no slot is free (the steady state: write-backs below make room first).
        cands = sorted((k for k in from_ram if k not in self.promoting and k not in self.gpu.cache
                        and hot[self._index(k)]), key=lambda k: -counts[self._index(k)]) if self.gpu.cache.free else ()
        for key in cands:
            if len(up) >= budget or moves <= 0 or self.gpu.cache.free == 0:
                break
            slot, evicted = self.gpu.cache.admit(key)
            assert evicted is None
            up.append((slot, self.ram.arena.tensor(self.ram.cache.slot_of(key), self.layout.dtype)))
            self.promoting.add(key)
            self.p.planner.note_promotion(key.layer)
            self._unsynced.append(("up", key))
            moves -= 1
        # Write back as many cold residents as hot records wait in RAM beyond the slots already free or freeing:
        # the coldest first, none the last step picked (it may be picked again before it has left). Where each
        # record is: the mirror (synced after every promotion; this call's are in `up`).
        in_gpu = (self.mirror_np >= 0) & (self.mirror_np < self.gpu_span)
        waiting = int((hot & ~in_gpu).sum()) - len(up)
        want = min(budget, moves, self.ram.cache.free, waiting - self.gpu.cache.free - len(self.demoting))
        if want > 0:
            cold = in_gpu & ~hot
            cold[picked] = False
            js = np.flatnonzero(cold)
            for j in js[np.argsort(counts[js], kind="stable")[:want]].tolist():
                victim = self.keys[j]
                r, evicted = self.ram.cache.admit(victim)
                assert evicted is None
                down.append((self.ram.arena.tensor(r, self.layout.dtype), self.gpu.cache.slot_of(victim)))
                self.demoting.add(victim)
                self._unsynced.append(("down", victim))
        if up or down:
            self.gpu.move(up, down, after=self._fence())
            self.promotions += len(up)
            self.demotions += len(down)

    def counters(self) -> dict:
        return {"picks": dict(self.picks), "read_in_place_bytes": self.read_in_place_bytes,
                "promotions": self.promotions, "demotions": self.demotions, "budget": self.budget(),
                "host_seconds": round(self.host_seconds, 4)}

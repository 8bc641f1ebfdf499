"""The lanes a tiered decode step's experts travel, the CPU expert lane, and the cost model between them.

A pick (one token's choice of one expert) is computed on one of two lanes:
  gpu  — from a GPU slot (the slot kernels); an expert not in a slot first crosses
  pcie — a copy RAM tier -> GPU slot (engine.tiers.gpu, a side stream);
  cpu  — straight from its RAM-tier slot on the CPU lane's thread, while the GPU computes the slot experts:
         4-bit records (rows or cols) in one native call a layer on the lane's pinned team, the GIL released
         (engine.kernels.lane); others by engine.tiers.waves.moe_forward (engine.kernels.cpu / quant_cpu). The
         CPU partial sum is copied to the device and added to the GPU's.
and an expert in neither tier first crosses
  disk — an O_DIRECT read store -> RAM tier (engine.tiers.readers).
The lanes run concurrently, so a layer takes about max(t_gpu, B_pcie/BW_pcie, B_disk/BW_disk, B_cpu/BW_cpu):
`split` chooses, per layer, which of the picks not already in a GPU slot cross PCIe and which the CPU
computes, so that the larger of the two lane times is smallest (the hottest experts cross PCIe: they are
the ones a GPU slot will serve again), and `promotions` copies hot CPU-lane experts into GPU slots in
the time the PCIe lane would otherwise idle. The choice never changes what is computed, only where
(tests/engine/test_cpu_lane.py: the same greedy tokens whichever lane computes).

The rates come from EngineConfig.lane_rates where given ("pcie=25,cpu=12,disk=6", GB/s), else are
measured by measure_rates (store reads and a slot copy at load, CPU expert FFNs at the first decode step);
the source of each is in the provider's counters. Measured rates vary from run to run, so two runs of auto
may split a layer differently: their results then differ by the device difference (the CPU's bf16 roundings
against the GPU kernels'), never more; --lane-rates, or --cpu-experts on/off, makes a run reproducible bit
for bit. LaneCounters keeps per lane the picks, bytes and busy seconds that a
benchmark sets beside that bound.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.engine_config import CPU_EXPERTS, parse_lane_rates
from engine.kernels import lane as lane_kernel
from engine.tiers.waves import group_routes, moe_forward

LANES = ("gpu", "cpu", "pcie", "disk")
LANE_NAMES = ("pcie", "cpu", "disk")      # the lanes with a rate (the GPU computes at HBM speed: not modelled)
GB = 1e9


@dataclass
class LaneCounter:
    picks: int = 0               # gpu/cpu: picks computed there; pcie: records copied; disk: records read
    bytes: int = 0               # record bytes the lane moved (pcie, disk) or computed from (gpu, cpu)
    seconds: float = 0.0         # busy time (cpu: the lane thread's jobs; pcie: copy-stream time; disk: batches)


@dataclass
class LaneCounters:
    lanes: dict[str, LaneCounter] = field(default_factory=lambda: {name: LaneCounter() for name in LANES})

    def add(self, lane: str, picks: int = 0, nbytes: int = 0, seconds: float = 0.0) -> None:
        c = self.lanes[lane]
        c.picks += picks
        c.bytes += nbytes
        c.seconds += seconds

    def as_dict(self) -> dict:
        return {name: {"picks": c.picks, "bytes": c.bytes, "seconds": round(c.seconds, 6)}
                for name, c in self.lanes.items()}


@dataclass(frozen=True)
class LaneRates:
    """Bytes per second of each lane: pcie (RAM -> GPU copies), cpu (expert records the CPU lane computes
    through, one token per pick), disk (store reads); source says per rate "config" or "measured"."""

    pcie: float
    cpu: float
    disk: float
    source: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"pcie_gbps": round(self.pcie / GB, 3), "cpu_gbps": round(self.cpu / GB, 3),
                "disk_gbps": round(self.disk / GB, 3), "source": dict(self.source)}


@dataclass(frozen=True)
class Candidate:
    """A pick group not in a GPU slot: one expert, the tokens routed to it, how often it was picked before."""

    expert: int
    tokens: int
    heat: int


def split(candidates: list[Candidate], rates: LaneRates, record_bytes: int, mode: str,
          copy_room: int) -> tuple[list[int], list[int]]:
    """→ (experts to copy to GPU slots, experts the CPU lane computes).

    mode "off": every one copied; "on": every one on the CPU; "auto": the hottest k copied and the rest on
    the CPU, k in 0..copy_room (the GPU slots this layer may still fill) minimising
    max(k·b/BW_pcie, Σ_rest tokens·b/BW_cpu) — the two lanes run at once, so the step waits for the slower.
    The CPU time is linear in a pick's tokens (BW_cpu is measured at one token): conservative for the few
    tokens per expert of a decode step, so a doubt goes to the GPU. Ties copy: a slot may serve again."""
    if mode not in CPU_EXPERTS:
        raise ValueError(f"cpu_experts {mode!r} is not one of {', '.join(CPU_EXPERTS)}")
    order = sorted(candidates, key=lambda c: (-c.heat, -c.tokens, c.expert))
    if mode == "off":
        return [c.expert for c in order], []
    if mode == "on":
        return [], [c.expert for c in order]
    copy_room = max(0, min(copy_room, len(order)))
    tail = [0.0] * (len(order) + 1)              # tail[k]: CPU seconds of order[k:]
    for i in range(len(order) - 1, -1, -1):
        tail[i] = tail[i + 1] + order[i].tokens * record_bytes / rates.cpu
    best_k, best_t = copy_room, float("inf")
    for k in range(copy_room, -1, -1):           # from the most copies down: the first minimum wins ties
        t = max(k * record_bytes / rates.pcie, tail[k])
        if t < best_t:
            best_k, best_t = k, t
    return [c.expert for c in order[:best_k]], [c.expert for c in order[best_k:]]


def promotions(cpu: list[Candidate], rates: LaneRates, record_bytes: int, copies: int, victim_heat: int | None,
               room: int) -> list[int]:
    """CPU-lane experts to copy into GPU slots as well (for their next picks, not this one): the hottest
    whose heat beats that of the slot they would evict (victim_heat; None: a free slot), as many as the
    PCIe lane can copy while the CPU lane computes (it idles otherwise), at most `room`."""
    if not cpu or room <= 0:
        return []
    cpu_seconds = sum(c.tokens for c in cpu) * record_bytes / rates.cpu
    idle = cpu_seconds - copies * record_bytes / rates.pcie
    n = min(room, int(idle * rates.pcie // record_bytes))
    hot = sorted(cpu, key=lambda c: (-c.heat, c.expert))
    return [c.expert for c in hot[:max(0, n)] if victim_heat is None or c.heat > victim_heat]


class CpuLane:
    """The CPU expert lane: one job per layer on a thread pinned to the lane CPUs (the recipe's `lane=`
    entry of --cpu-layout). For 4-bit records the job is ONE native call (engine.kernels.lane.moe: the layer's
    picks split over `team`, one thread per lane CPU, each pinned to its own; the GIL released meanwhile);
    for the others moe_forward on torch's intra-op threads, which that thread starts and which inherit its
    CPU set, so they run there and not on the readers' or the main thread's CPUs."""

    def __init__(self, cpus: set[int] | None = None):
        allowed = os.sched_getaffinity(0)
        self.cpus = (cpus & allowed) or None if cpus else None
        self.team = lane_kernel.Team.for_cpus(self.cpus)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpu-lane", initializer=self._pin)
        self._lock = threading.Lock()

    def _pin(self) -> None:
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)

    def submit(self, fn, *args) -> Future:
        """Run fn(*args) on the lane under inference mode → a Future of (its result, busy seconds)."""
        def job():
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = fn(*args)
            return out, time.perf_counter() - t0
        return self._pool.submit(job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def native_picks(layout, x: torch.Tensor, topk_weights: torch.Tensor, routes, address) -> tuple | None:
    """The arguments of engine.kernels.lane.moe for `routes` (experts ascending, tokens ascending in each: the
    order moe_forward sums them in), address(expert) → its record's host address; None where the lane kernel
    does not take this layout (moe_forward computes it then)."""
    if not lane_kernel.supports(layout):
        return None
    w = topk_weights.float()
    tokens, records, weights = [], [], []
    for r in routes:
        a = address(r.expert)
        for t, k in zip(r.tokens, r.ks):
            tokens.append(t)
            records.append(a)
            weights.append(float(w[t, k]))
    return x, tokens, records, weights, layout.quantized


def _median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def measure_disk(provider) -> float:
    """Store read rate, bytes/s: one batch of up to 2×readers records of the first MoE layer read into free
    RAM slots (they stay there: the cold RAM tier's first content). Called at load, before anything is cached."""
    m, ram = provider.manifest, provider.ram
    layer = m.moe_layers[0]
    n = max(1, min(2 * ram.readers.threads, ram.cache.capacity, m.experts_per_layer))
    t0 = time.perf_counter()
    before = ram.readers.bytes_read
    ram.fetch(layer, list(range(n)), ())
    return max(ram.readers.bytes_read - before, m.record_bytes) / max(time.perf_counter() - t0, 1e-9)


def measure_rates(provider, given: str | None = None, lanes=LANE_NAMES, known: dict | None = None,
                  reps: int = 5) -> dict[str, tuple[float, str]]:
    """{lane: (bytes/s, "config" | "measured")}: the rates `given` ("pcie=25,cpu=12,disk=6" GB/s,
    EngineConfig.lane_rates) as they are, those in `known` (an earlier call's), and of the rest those in
    `lanes` measured now on the provider's own tiers:
      disk — measure_disk (at load, before anything is cached);
      pcie — the median of `reps` copies of a RAM-tier record into a GPU slot (a CUDA device, at load, while
             the slots are still zeros, which they are again after; on the CPU "device" lane a memcpy);
      cpu  — measure_cpu: the lane's own kernel on the lane thread (4-bit records: the native call over a decode
             step's top-k picks on the lane's team; else one-token expert FFNs with the serving torch threads):
             the provider measures it at its first decode step, not at load, where the loader runs on one thread."""
    out = {k: (v * GB, "config") for k, v in parse_lane_rates(given).items()}
    out.update({k: v for k, v in (known or {}).items() if k not in out})
    todo = [lane for lane in lanes if lane not in out]
    ram, layout = provider.ram, provider.layout
    if "disk" in todo:
        out["disk"] = measure_disk(provider), "measured"
    if "cpu" not in todo and "pcie" not in todo:
        return out
    key = next(iter(ram.cache.resident()), None)
    if key is None:
        measure_disk(provider)
        key = next(iter(ram.cache.resident()))
    slot = ram.arena.tensor(ram.cache.slot_of(key), layout.dtype)
    if "pcie" in todo:
        gpu = provider.gpu
        assert len(gpu.cache) == 0, "the PCIe rate is measured before the GPU tier fills"
        dst = gpu.data[0]

        def copy():
            dst.copy_(slot, non_blocking=gpu.cuda)
            if gpu.cuda:
                torch.cuda.synchronize(gpu.device)
        copy()                                 # the first copy pays for setup
        out["pcie"] = layout.record_bytes / _median_seconds(copy, reps), "measured"
        dst.zero_()                            # slots the cache has not filled stay zeros (see GpuTier)
    if "cpu" in todo:
        out["cpu"] = measure_cpu(provider, slot, reps), "measured"
    return out


def measure_cpu(provider, slot: torch.Tensor, reps: int = 5, picks: int = 8) -> float:
    """The CPU lane's rate, bytes/s of records computed through, on the lane thread with its team: for records the
    lane kernel takes, the median of `reps` native calls over up to `picks` distinct RAM-tier records for one
    token (a decode step's top-k, every pick on the CPU); else `reps` one-token moe_forward calls on `slot`."""
    layout, ram = provider.layout, provider.ram
    if lane_kernel.supports(layout):
        keys = list(ram.cache.resident())[:picks] or []
        addrs = [ram.arena.host_address(ram.cache.slot_of(k)) for k in keys] or [slot.data_ptr()]
        x = torch.randn(1, layout.hidden)
        team = provider.lane.team
        call = lambda: lane_kernel.moe(x, [0] * len(addrs), addrs, [1.0] * len(addrs), layout.quantized, team)  # noqa: E731
        warm = lambda: (call(), _median_seconds(call, reps))[1]    # noqa: E731  (the first call starts and pins the team)
        secs = provider.lane.submit(warm).result()[0]
        return len(addrs) * layout.payload_bytes / secs
    dtype = torch.float32 if layout.quantized else layout.dtype
    x = torch.randn(1, layout.hidden).to(dtype)
    w = torch.ones(1, 1, dtype=dtype)
    routes = group_routes(torch.zeros(1, 1, dtype=torch.long))
    views = [layout.views(slot)]
    ffn = lambda: moe_forward(x, w, routes, lambda wave: views, 1)      # noqa: E731
    secs = provider.lane.submit(_median_seconds, ffn, reps).result()[0]
    return layout.payload_bytes / secs


def lane_rates(measured: dict[str, tuple[float, str]]) -> LaneRates:
    """LaneRates from measure_rates' dict, once it holds every lane."""
    return LaneRates(measured["pcie"][0], measured["cpu"][0], measured["disk"][0],
                     {k: v[1] for k, v in measured.items()})


def lane_bound(counters: dict, t_gpu: float = 0.0) -> dict:
    """The lane bound of a run from two TieredExperts.counters() differences or one (picks/bytes over the run):
    {"gpu", "pcie", "disk", "cpu": seconds each lane needs at its rate, "bound": their max} — the time no
    schedule of the run's transfers and CPU experts can beat, t >= max(t_gpu, B_pcie/BW_pcie, B_disk/BW_disk,
    B_cpu/BW_cpu). t_gpu: the GPU's own compute time, which the counters do not time (e.g. an all-resident run's
    step time). Without lane rates (no CPU lane) the terms that need them are None."""
    lanes, rates = counters.get("lanes") or {}, counters.get("lane_rates")
    out: dict = {"gpu": t_gpu}
    for lane in LANE_NAMES:
        b = (lanes.get(lane) or {}).get("bytes", 0)
        out[lane] = b / (rates[f"{lane}_gbps"] * GB) if rates else None
    out["bound"] = max(v for v in out.values() if v is not None)
    return out

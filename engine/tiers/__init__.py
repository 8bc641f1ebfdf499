"""Expert tiers: where routed experts live while a model runs.

The providers, one per placement (build_provider picks one and logs why):
  memory    — InMemoryExperts: every expert in memory (the CPU; the reference); in_memory() builds it
  resident  — ResidentExperts: every expert on the GPU, slots computed on the device (graph-capturable)
  tiered    — TieredExperts: GPU slots ← page-locked RAM ← O_DIRECT store (CPU: RAM ← store)
and the tiers they are built from:
  cache     — ExpertCache, eviction policies (LRU, LFU; Belady for the simulator), counters
  ram       — the RAM arena (cudaHostRegister'ed on CUDA) and RamTier (arena + cache + store readers)
  gpu       — GpuTier: GPU slots filled from the RAM tier on a side stream
  lanes     — the CPU expert lane, the lane cost model (compute on the CPU vs copy to the GPU), lane counters
  zero_copy — a tiered decode step that reads RAM-tier records in place (no host step: one graph a step)
  readers   — O_DIRECT store readers (threads, optionally pinned to CPUs)
  waves     — the CPU waves the host-memory providers share (group_routes, moe_forward)
simulate  — `engine simulate-cache`: policies vs Belady on a recorded routing trace
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint import Checkpoint
from engine.cpu_layout import parse_cpu_layout
from engine.errors import EngineError, Exit
from engine.experts.layout import DTYPES, order_for
from engine.experts.provider import ExpertProvider
from engine.engine_config import EXPERTS, EngineConfig
from engine.model_source import open_checkpoint
from engine.store import manifest as mf
from engine.store.odirect import probe
from engine.store.source import record_source
from engine.tiers.gpu import default_gpu_slots, gpu_reserve
from engine.tiers.memory import InMemoryExperts
from engine.tiers.ram import default_ram_slots

log = logging.getLogger("engine.tiers")
GIB = 1 << 30


def _as_checkpoint(checkpoint):
    return open_checkpoint(checkpoint)


def in_memory(checkpoint, *, device="cpu", dtype: torch.dtype | None = None, order: str | None = None,
              quant: str = "none") -> InMemoryExperts:
    """Every routed expert packed into memory (the reference provider, and small models), in record
    `order` (default: the one the device computes fastest from); quant "int8"/"int4": quantized records; a
    GGUF model's experts stay the file's own blocks where a record keeps them (Checkpoint.record_quant)."""
    ck = _as_checkpoint(checkpoint)
    if quant == "none":
        quant = ck.record_quant()
    layout, make = record_source(ck, dtype=None if quant != "none" else dtype, order=order or order_for(device),
                                 quant=quant)
    records = {l: torch.stack([make(l, e) for e in range(ck.n_experts)]).to(device) for l in ck.moe_layers}
    return InMemoryExperts(layout, records)


@dataclass(frozen=True)
class ExpertPlacement:
    """Which provider serves the experts, and why (logged at load)."""

    kind: str                # "memory" (CPU, all in memory), "resident" (all on the GPU), "tiered"
    reason: str


def choose_placement(mode: str, device_type: str, *, has_store: bool, expert_bytes: int,
                     gpu_budget_bytes: int | None) -> ExpertPlacement:
    """auto: on a CUDA device every expert on the GPU when they fit its budget (gpu_budget_bytes: free
    VRAM minus a reserve, or the --gpu-slots cap), else tiered; on the CPU all in memory without a
    store, tiered with one. resident / tiered force the choice. Raises EngineError for a choice that
    cannot be made (tiered without a store)."""
    if mode not in EXPERTS:
        raise EngineError(f"--experts {mode!r} is not one of {', '.join(EXPERTS)}", Exit.USAGE)
    gib = lambda n: f"{n / GIB:.2f} GiB"          # noqa: E731
    if mode == "tiered" and not has_store:
        raise EngineError("--experts tiered needs a packed expert store (--store; engine pack-store)", Exit.USAGE)
    if device_type != "cuda":
        if mode == "resident" or (mode == "auto" and not has_store):
            return ExpertPlacement("memory", f"every expert in memory ({gib(expert_bytes)})")
        return ExpertPlacement("tiered", f"RAM tier over the store ({gib(expert_bytes)} of experts)")
    if mode == "resident":
        return ExpertPlacement("resident", f"--experts resident: {gib(expert_bytes)} of experts on the GPU")
    if mode == "tiered":
        return ExpertPlacement("tiered", f"--experts tiered: {gib(expert_bytes)} of experts over "
                                         f"GPU slots <- RAM <- store")
    if gpu_budget_bytes is not None and expert_bytes <= gpu_budget_bytes:
        return ExpertPlacement("resident", f"{gib(expert_bytes)} of experts fit the GPU budget of "
                                           f"{gib(gpu_budget_bytes)}: all resident")
    if not has_store:
        return ExpertPlacement("resident", f"{gib(expert_bytes)} of experts exceed the GPU budget of "
                                           f"{gib(gpu_budget_bytes or 0)}, but there is no store to tier "
                                           f"them from: all resident")
    return ExpertPlacement("tiered", f"{gib(expert_bytes)} of experts exceed the GPU budget of "
                                     f"{gib(gpu_budget_bytes or 0)}: tiered")


def build_provider(checkpoint, store_dir, config: EngineConfig | None = None, *,
                   trace: str | os.PathLike | None = None, **knobs) -> ExpertProvider:
    """The expert provider for `checkpoint` (a Checkpoint or its directory), as `config` (or keyword
    knobs: EngineConfig's fields) says: InMemoryExperts, ResidentExperts (CUDA) or TieredExperts, chosen
    by choose_placement from config.experts and logged with the sizes.

    store_dir: the packed store (it must come from this checkpoint; config.dtype, the record dtype, must
    then be None or the store's). gpu_slots / ram_slots None: sized from free VRAM / the memory cgroup
    (logged); on CUDA a gpu_slots below the store's records also makes `auto` tier.
    cpu_layout: e.g. "lane=2-23;readers=26-39" pins the CPU expert lane's and the readers' threads.
    config.cpu_experts (auto/on/off) and config.lane_rates: the CPU expert lane of a tiered CUDA provider
    (engine.tiers.lanes; the CPU device computes every expert on the CPU already). trace: append routing
    (JSON lines).
    """
    config = EngineConfig.of(config, **knobs)
    gpu_slots, ram_slots, readers = config.gpu_slots, config.ram_slots, config.readers
    cpu_layout, policy, experts = config.cpu_layout, config.policy, config.experts
    ck = _as_checkpoint(checkpoint)
    dtype = DTYPES[config.dtype] if config.dtype else None
    device = torch.device(config.device)
    m = None
    if store_dir is not None:
        m = mf.load(store_dir)
        mf.check_matches(m, ck, store_dir)
        if dtype is not None and m.quant == "none" and dtype != m.layout.dtype:   # quantized records: any compute dtype
            raise EngineError(f"{Path(store_dir)}: holds {m.dtype} records, {str(dtype).removeprefix('torch.')} was "
                              f"asked for (repack with `engine pack-store --dtype`)", Exit.BAD_MODEL)
        mf.check_order(m, device, store_dir)
        probe(store_dir)
        n, record_bytes = len(m.records), m.record_bytes
    else:           # the records from_checkpoint / in_memory will make: a GGUF's own blocks where it has them
        quant = ck.record_quant()
        lay = ck.layout(dtype) if quant == "none" else record_source(ck, order="rows", quant=quant)[0]
        n, record_bytes = len(ck.moe_layers) * ck.n_experts, lay.record_bytes
    budget = None
    if device.type == "cuda":
        if gpu_slots is not None:
            budget = gpu_slots * record_bytes
        else:
            free, total = torch.cuda.mem_get_info(device)
            budget = max(0, free - gpu_reserve(total))
    placement = choose_placement(experts, device.type, has_store=m is not None, expert_bytes=n * record_bytes,
                                 gpu_budget_bytes=budget)
    log.info("experts: %s (%d records of %.1f MiB on %s): %s", placement.kind, n, record_bytes / (1 << 20),
             device, placement.reason)

    if placement.kind == "memory":
        return in_memory(ck, device=device, dtype=dtype)
    if placement.kind == "resident":
        from engine.tiers.resident import ResidentExperts   # imports triton (the slot kernels): not at a command's start
        if m is not None:
            return ResidentExperts.from_store(store_dir, device)
        return ResidentExperts.from_checkpoint(ck, device, dtype)

    from engine.tiers.tiered import TieredExperts          # imports triton (the slot kernels): not at a command's start
    if ram_slots is None:
        ram_slots = default_ram_slots(m.record_bytes, n)
    if device.type == "cuda":
        if gpu_slots is None:
            gpu_slots = default_gpu_slots(device, m.record_bytes, n)
        if gpu_slots < 1:
            raise EngineError(f"GPU tier: no room for one {m.record_bytes}-byte expert slot on {device}", Exit.IO)
    else:
        gpu_slots = 0                  # the CPU computes straight from the RAM tier
    if ram_slots < 1:
        raise EngineError("RAM tier: no room for one expert slot (set --ram-slots)", Exit.IO)
    layout_cpus = parse_cpu_layout(cpu_layout)
    reader_cpus = layout_cpus.get("readers")
    readers = readers or max(1, min(16, len(reader_cpus or os.sched_getaffinity(0))))
    cpu_experts = config.cpu_experts if device.type == "cuda" else "off"
    log.info("expert tiers: %d GPU slots, %d RAM slots, %d store readers%s, policy %s, CPU experts %s", gpu_slots,
             ram_slots, readers, f" on CPUs {sorted(reader_cpus)}" if reader_cpus else "", policy, cpu_experts)
    provider = TieredExperts(m, store_dir, device=device, ram_slots=min(ram_slots, n), gpu_slots=min(gpu_slots, n),
                             readers=readers, reader_cpus=reader_cpus, policy=policy, trace=trace,
                             cpu_experts=cpu_experts, lane_cpus=layout_cpus.get("lane"), lane_rates=config.lane_rates,
                             placement=config.placement)
    try:
        if config.preload:
            provider.preload()
        provider.use_zero_copy(config.zero_copy)
    except BaseException:
        provider.close()
        raise
    return provider


__all__ = ["EXPERTS", "ExpertPlacement", "build_provider", "choose_placement", "in_memory"]

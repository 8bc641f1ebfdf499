"""Expert tiers: where routed experts live while a model runs.

memory    — InMemoryExperts, every expert held in memory (no store)
cache     — ExpertCache, eviction policies (LRU, LFU; Belady for the simulator), counters
ram/gpu   — the RAM arena (cudaHostRegister'ed on CUDA) and the GPU slot arena
readers   — O_DIRECT store readers (threads, optionally pinned to CPUs)
tiered    — TieredExperts, the ExpertProvider over GPU ← RAM ← store
simulate  — `engine simulate-cache`: policies vs Belady on a recorded routing trace
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from engine.experts import DTYPES, ExpertProvider, order_for
from engine.runtime import EngineConfig
from engine.tiers.memory import InMemoryExperts

log = logging.getLogger("engine.tiers")


def _as_checkpoint(checkpoint):
    from engine.checkpoint import Checkpoint
    return checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)


def in_memory(checkpoint, *, device="cpu", dtype: torch.dtype | None = None, order: str | None = None,
              quant: str = "none") -> InMemoryExperts:
    """Every routed expert packed into memory (the reference provider, and small models), in record
    `order` (default: the one the device computes fastest from); quant "int8"/"int4": quantized records."""
    ck = _as_checkpoint(checkpoint)
    layout = ck.layout(dtype, order or order_for(device), quant)
    records = {l: torch.stack([layout.pack(*ck.expert(l, e)) for e in range(ck.n_experts)]).to(device)
               for l in ck.moe_layers}
    return InMemoryExperts(layout, records)


def build_provider(checkpoint, store_dir, config: EngineConfig | None = None, *,
                   trace: str | os.PathLike | None = None, **knobs) -> ExpertProvider:
    """The expert provider for `checkpoint` (a Checkpoint or its directory), as `config` (or keyword
    knobs: EngineConfig's fields) says.

    store_dir None: all experts in memory. Else a TieredExperts over the packed store, which must
    come from this checkpoint; config.dtype (the record dtype) must then be None or the store's.
    gpu_slots / ram_slots None: sized from free VRAM / the memory cgroup (logged).
    cpu_layout: e.g. "readers=26-39" pins the reader threads. trace: append routing (JSON lines).
    """
    from engine.errors import EngineError, Exit
    config = EngineConfig.of(config, **knobs)
    gpu_slots, ram_slots, readers = config.gpu_slots, config.ram_slots, config.readers
    cpu_layout, policy = config.cpu_layout, config.policy
    ck = _as_checkpoint(checkpoint)
    dtype = DTYPES[config.dtype] if config.dtype else None
    device = torch.device(config.device)
    if store_dir is None:
        return in_memory(ck, device=device, dtype=dtype)

    from engine.store import manifest as mf
    from engine.store.odirect import probe
    from engine.tiers.gpu import default_gpu_slots
    from engine.tiers.ram import default_ram_slots
    from engine.tiers.readers import parse_cpu_layout
    from engine.tiers.tiered import TieredExperts

    m = mf.load(store_dir)
    mf.check_matches(m, ck, store_dir)
    if dtype is not None and m.quant == "none" and dtype != m.layout.dtype:   # quantized records: any compute dtype
        raise EngineError(f"{Path(store_dir)}: holds {m.dtype} records, {str(dtype).removeprefix('torch.')} was "
                          f"asked for (repack with `engine pack-store --dtype`)", Exit.BAD_MODEL)
    mf.check_order(m, device, store_dir)
    probe(store_dir)
    n = len(m.records)
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
    reader_cpus = parse_cpu_layout(cpu_layout).get("readers")
    readers = readers or max(1, min(16, len(reader_cpus or os.sched_getaffinity(0))))
    log.info("expert tiers: %d GPU slots, %d RAM slots, %d store readers%s, policy %s", gpu_slots, ram_slots,
             readers, f" on CPUs {sorted(reader_cpus)}" if reader_cpus else "", policy)
    return TieredExperts(m, store_dir, device=device, ram_slots=min(ram_slots, n), gpu_slots=min(gpu_slots, n),
                         readers=readers, reader_cpus=reader_cpus, policy=policy, trace=trace)


__all__ = ["build_provider", "in_memory"]

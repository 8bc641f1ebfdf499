"""The CPU layout knob (--cpu-layout 'lane=2-23;readers=26-39'): which CPUs the CPU expert lane's and the store
readers' threads are pinned to. Parsed where the config is checked (engine.engine_config) and where the threads start
(engine.tiers); free of torch, as the config is."""
from __future__ import annotations

from engine.errors import EngineError, Exit


def parse_cpulist(text: str) -> set[int]:
    """'26-39,41' -> {26, ..., 39, 41}. tool.cpulist has the tool's copy: the packages never import each
    other (the tool runs where torch is not installed), so the kernel's CPU-list format is parsed twice."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def parse_cpu_layout(text: str | None) -> dict[str, set[int]]:
    """'cpu=2-23;main=24;readers=26-39' (entries split by ';' or spaces) -> {name: cpus}."""
    out: dict[str, set[int]] = {}
    for entry in (text or "").replace(";", " ").split():
        name, eq, cpus = entry.partition("=")
        try:
            if not eq:
                raise ValueError
            out[name] = parse_cpulist(cpus)
        except ValueError:
            raise EngineError(f"--cpu-layout: {entry!r} is not NAME=CPULIST (e.g. readers=26-39)", Exit.USAGE) from None
    return out

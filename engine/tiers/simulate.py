"""Replay a recorded routing trace through the eviction policies.

A trace is JSON lines, one per MoE layer call: {"layer": 3, "experts": [1, 5, 7]} (what
TieredExperts writes with trace=FILE). Each expert of a line is one access, in order; a miss
admits the expert (demand caching), the model in which Belady's MIN is optimal, so its hit
rate bounds every policy from above on that trace.
"""
from __future__ import annotations

import json
from pathlib import Path

from engine.errors import EngineError, Exit
from engine.tiers.cache import POLICIES, Belady, EvictionPolicy, ExpertCache, ExpertKey, TierStats


def read_trace(path: str | Path) -> list[ExpertKey]:
    accesses: list[ExpertKey] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise EngineError(f"{path}: cannot read ({e.strerror})", Exit.USAGE) from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
            layer = int(step["layer"])
            accesses.extend(ExpertKey(layer, int(e)) for e in step["experts"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise EngineError(f"{path} line {n}: not a routing step {{\"layer\": L, \"experts\": [..]}} "
                              f"({type(e).__name__})", Exit.USAGE) from None
    return accesses


def simulate(accesses: list[ExpertKey], slots: int, policy: EvictionPolicy) -> TierStats:
    cache = ExpertCache(policy.name, slots, policy)
    for key in accesses:
        if cache.lookup(key) is None:
            cache.admit(key)
    return cache.stats


def compare(accesses: list[ExpertKey], slots: int) -> dict[str, TierStats]:
    out = {name: simulate(accesses, slots, cls()) for name, cls in POLICIES.items()}
    out["belady"] = simulate(accesses, slots, Belady(accesses))
    return out

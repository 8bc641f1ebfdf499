"""`engine simulate-cache`: replay a recorded routing trace through the eviction policies.

A trace is JSON lines, one per MoE layer call: {"layer": 3, "experts": [1, 5, 7]} (what
TieredExperts writes with trace=FILE). Each expert of a line is one access, in order; a miss
admits the expert (demand caching), the model in which Belady's MIN is optimal, so its hit
rate bounds every policy from above on that trace.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

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


@click.command("simulate-cache")
@click.option("--trace", "trace_path", required=True, type=click.Path(dir_okay=False),
              help="Routing trace (JSON lines {\"layer\", \"experts\"}, as written by the tiers' trace option).")
@click.option("--slots", required=True, type=click.IntRange(min=1), help="Cache slots (experts held).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def simulate_cache(trace_path, slots, as_json):
    """Compare expert-cache eviction policies (LRU, LFU) with Belady's optimum on a routing trace."""
    accesses = read_trace(trace_path)
    if not accesses:
        raise EngineError(f"{trace_path}: holds no routing steps", Exit.USAGE)
    results = compare(accesses, slots)
    if as_json:
        click.echo(json.dumps({"trace": str(trace_path), "accesses": len(accesses), "slots": slots,
                               "policies": {k: v.as_dict() for k, v in results.items()}}))
        return
    from rich.console import Console
    from rich.table import Table
    distinct = len(set(accesses))
    table = Table(title=f"{len(accesses)} accesses, {distinct} distinct experts, {slots} slots")
    for col in ("policy", "hits", "misses", "evictions", "hit rate"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, s in results.items():
        table.add_row(name, str(s.hits), str(s.misses), str(s.evictions), f"{s.hit_rate:.2%}")
    Console().print(table)

"""`engine simulate-cache`: eviction policies against Belady's optimum on a routing trace (engine.tiers.simulate)."""
from __future__ import annotations

import json

import click

from engine.errors import EngineError, Exit
from engine.tiers.simulate import compare, read_trace


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

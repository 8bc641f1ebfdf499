"""`tool list`: every recipe with its model, card, runtime, context, proof, and whether it fits this host.

"Fits" comes from the preflight's own probes (GPU count and VRAM, RAM, CPUs, disk), without the
slow or writing ones (no O_DIRECT probe, no Docker), so the list stays fast.
"""
from __future__ import annotations

import json

import click

from tool.cli import options
from tool import preflight as pf
from tool.errors import RecipeError, printable


def proof_of(recipe: dict) -> dict:
    """The latest proof: gates passed of gates run, decode tok/s."""
    gates = recipe.get("checks", {}).get("gates", [])
    proofs = recipe.get("proof") or []
    last = max(proofs, key=lambda p: p.get("date", "")) if proofs else {}
    return {"date": last.get("date"), "gates": gates, "gates_passed": last.get("gates_passed", []),
            "decode_tps": last.get("decode_tps")}


def proof_text(p: dict) -> str:
    if not p["date"]:
        return "not yet proven"
    passed = [g for g in p["gates"] if g in p["gates_passed"]]
    tps = f" · {p['decode_tps']:g} tok/s" if p["decode_tps"] is not None else ""
    return f"{len(passed)}/{len(p['gates'])} gates{tps}"


# What a failing fit check means, in the words of `tool list`'s last column.
SHORT = {"gpu.count": "GPUs", "gpu.vram": "VRAM", "mem.total": "RAM", "cpu.count": "CPUs",
         "cpu.features": "CPU features", "disk.models.free": "disk", "disk.store.free": "disk"}


def why_not_text(fail_ids: list[str]) -> str:
    return ", ".join(dict.fromkeys(SHORT.get(i, i) for i in fail_ids))


def row(recipe, host) -> dict:

    r = recipe.data
    hw = r["hardware"]
    results = pf.fits(r, host)
    fails = pf.failures(results)
    return {
        "id": r["id"],
        "model": r["model"]["name"],
        "card": hw.get("card_name", hw.get("card")),
        "gpus": hw.get("gpu_count", 0),
        "runtime": r["runtime"]["kind"],
        "context": r["serve"]["context"],
        "proof": proof_of(r),
        "fits": not fails,
        "why_not": [c.as_dict() for c in fails],
        "path": str(recipe.path),
    }


def valid_recipes() -> list:
    """Every recipe that validates; each one that does not is named on stderr (one line) and left out,
    so one broken file in $KILN_RECIPES does not hide the others."""
    from tool.recipes import index, load  # jsonschema: not at the CLI's start

    out = []
    for path in index().values():
        try:
            out.append(load(str(path)))
        except RecipeError as e:
            click.echo(f"tool: left out an invalid recipe: {printable(e.message)}", err=True)
    return out


@click.command("list")
@click.option("--fits", "only_fits", is_flag=True, help="Only the recipes that fit this host.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as a JSON list on stdout.")
@options.models_dir
@options.store_dir
@options.host_root
def list_(only_fits, as_json, models_dir, store_dir, host_root):
    """List the recipes and whether each fits this host (GPU count and VRAM, RAM, CPUs, disk)."""

    host = pf.host_from_env(models_dir, store_dir, host_root)
    rows = [row(r, host) for r in sorted(valid_recipes(), key=lambda r: r.id)]
    if only_fits:
        rows = [x for x in rows if x["fits"]]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    import sys

    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("recipe", "model", "card", "runtime", "context", "proof", "fits here"):
        t.add_column(col, overflow="fold")
    for x in rows:
        card = f"{x['gpus']}× {x['card']}" if x["gpus"] > 1 else x["card"]
        why = "[green]yes[/]" if x["fits"] else "[red]no[/]: " + why_not_text([f["id"] for f in x["why_not"]])
        # recipe text is data: "[red]" in a model name is printed, not styled
        t.add_row(*map(escape, (x["id"], x["model"], card, x["runtime"], f"{x['context'] // 1024}K", proof_text(x["proof"]))), why)
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(t)

"""`tool recipe new FILE.gguf --card CARD`: write a native recipe for a GGUF file on this host."""
from __future__ import annotations

from pathlib import Path

import click


@click.group("recipe")
def recipe():
    """Write recipes."""


@recipe.command("new")
@click.argument("gguf", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--card", required=True,
              help="'any' for the CPU, or a GPU card's slug ending in its VRAM (rtx-3090-24gb, h200-141gb).")
@click.option("--ctx", "context", type=click.IntRange(min=256), default=None,
              help="Context window in tokens [default: 8192, capped by the file's].")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Where to write it [default: ./<id>.kiln.<ctx>k.json].")
def new(gguf, card, context, out):
    """Write a native recipe serving GGUF (a local file, pinned by its sha256) with Kiln's engine on CARD.

    The engine checks the file whole first (`engine verify-model`: exit 3 naming what is wrong); the store's
    size, the RAM tier and (on a GPU) the expert slots follow from its shape and the card's budget. The recipe
    is validated before it is written; `tool preflight FILE.json` then says whether this host runs it, and
    `tool up FILE.json` runs it (fetch copies the file in and checks the copy's sha256)."""
    from tool.recipe_new import build, describe, write  # jsonschema, requests: not at the CLI's start

    data = build(gguf, card, describe(gguf), context)
    path = write(data, out or Path(f"{data['id']}.kiln.{data['serve']['context'] // 1024}k.json"))
    click.echo(str(path))

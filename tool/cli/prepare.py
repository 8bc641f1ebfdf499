"""`tool prepare RECIPE`: the recipe's prepare step in staging, verified, published by rename."""
from __future__ import annotations

import json

import click

from tool.cli import options
from tool.prepare import prepare as do_prepare
from tool.state import Dirs


@click.command("prepare")
@click.argument("recipe")
@click.option("--force", is_flag=True, help="Rebuild even when the published store verifies (or no longer does).")
@click.option("--json", "as_json", is_flag=True, help="Print {recipe, status, store, detail, seconds} as JSON.")
@options.dirs
def prepare(recipe, force, as_json, state_dir, models_dir, store_dir):
    """Run RECIPE's prepare step with the store in a staging directory, run its verify step on the result,
    then publish it by rename. Skipped when the published store verifies; a published store that no longer
    verifies is refused unless --force. A failure or Ctrl-C leaves the published store (or none) as it was.

    Exit codes: 0 ok, 1 the step failed, 3 bad recipe, 4 engine/docker missing, 5 not writable,
    6 filesystem refused, 8 the store does not verify, 130 interrupted.
    """
    from tool.recipes import load as load_recipe  # jsonschema: not at the CLI's start

    r = load_recipe(recipe)
    result = do_prepare(r, Dirs.resolve(state_dir, models_dir, store_dir), force=force)
    if as_json:
        click.echo(json.dumps({"recipe": r.id, "status": result.status, "store": str(result.store or ""),
                               "detail": result.detail, "seconds": round(result.seconds, 3)}, indent=2))
    else:
        click.echo(f"{r.id}: {result.status}: {result.detail} ({result.seconds:.1f} s)")

"""`tool verify RECIPE`: re-hash the fetched weights and verify the prepared store, offline."""
from __future__ import annotations

import json

import click

from tool.cli import options
from tool.errors import Exit, IntegrityError, KilnError
from tool.fetch import Progress
from tool.store_verify import stores_dir, verify_store
from tool.weights import models_dir as resolve_models, verify_offline


@click.command("verify")
@click.argument("recipe")
@options.models_dir
@options.store_dir
@click.option("--weights-only", is_flag=True, help="Check the weights only, not the prepared store.")
@click.option("--json", "as_json", is_flag=True, help="Print {recipe, weights, store} as JSON on stdout.")
@click.pass_context
def verify(ctx, recipe, models_dir, store_dir, weights_only, as_json):
    """Re-hash RECIPE's weights against the fetch marker and the recipe's pins, check the prepared store's
    manifests against the sha256 `tool prepare` recorded, then run the plan's store verify step (the
    engine's O_DIRECT re-read of every record and, for a converted model, the sha256 of every file it
    serves; a container step only when docker answers).

    A file that no longer matches is named with both digests and its marker removed. Exit codes: 0 ok,
    1 not fetched / not prepared, 6 filesystem refused, 8 mismatch (a record, a model file, a manifest).
    """
    from tool.recipes import load as load_recipe  # jsonschema: not at the CLI's start

    r = load_recipe(recipe)
    models = resolve_models(models_dir)
    stores = stores_dir(store_dir)
    progress = Progress()
    with progress:
        with progress.task("re-hash", r["weights"].get("size_bytes")) as advance:
            w = verify_offline(r, models, advance)
    store = None if weights_only or not w.ok else verify_store(r, models, stores)

    if as_json:
        click.echo(json.dumps({"recipe": r.id, "weights": {
            "where": str(w.where), "ok": w.ok, "files": w.files, "bytes": w.bytes, "problem": w.problem,
            "mismatches": [m.__dict__ for m in w.mismatches]}, "store": store.as_dict() if store else None}, indent=2))
    else:
        if w.ok:
            click.echo(f"weights  ok          {w.files} files, {w.bytes} bytes match the marker and the recipe's pins")
        if store is not None:
            click.echo(f"store    {store.status:<11} {store.detail}")
    for m in w.mismatches:
        click.echo(f"tool: {m}", err=True)
    if w.problem:
        raise KilnError(w.problem, Exit.FAILED)
    if w.mismatches:
        more = f" (+{len(w.mismatches) - 1} more above)" if len(w.mismatches) > 1 else ""
        raise IntegrityError(f"{w.where}: {w.mismatches[0]}{more}; marker removed, run `tool fetch {r.id}`")
    if store is not None and store.exit_code != Exit.OK:
        raise KilnError(f"store: {store.detail}", store.exit_code)


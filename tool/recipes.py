"""Find and load recipes: by id (from recipes/ or $KILN_RECIPES) or by path.

The one loader: `load(ref)` resolves the reference, reads the file (tool.recipe_file) and validates it
(tool.validate), so nothing downstream sees an invalid recipe. Imports go one way, recipes → validate →
recipe_file.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path

from tool.errors import RecipeError
from tool.recipe_file import Recipe, parse, recipe_files
from tool.validate import validate_recipe


def index(dirs: list[Path] | None = None) -> dict[str, Path]:
    """id -> file, for every recipe that parses (invalid files are tool validate's business)."""
    out: dict[str, Path] = {}
    for p in recipe_files(dirs):
        try:
            rid = parse(p).data.get("id")
        except RecipeError:
            continue
        if isinstance(rid, str) and rid not in out:
            out[rid] = p
    return out


def resolve(ref: str) -> Path:
    """A recipe id or a path → the file. Unknown ids get the close ones suggested."""
    p = Path(ref)
    if p.suffix == ".json" or os.sep in ref:
        if not (os.path.lexists(p)):
            raise RecipeError(f"{ref}: no such recipe file")
        return p  # parse() says what is wrong with anything that is not a regular file
    ids = index()
    if ref in ids:
        return ids[ref]
    close = difflib.get_close_matches(ref, list(ids), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(ids))}"
    raise RecipeError(f"unknown recipe {ref!r}{hint}")


def load(ref: str, validate: bool = True) -> Recipe:
    """Resolve, parse and (by default) validate; invalid recipes raise RecipeError naming the first error."""
    recipe = parse(resolve(ref))
    if validate:
        errors = validate_recipe(recipe)
        if errors:
            more = f" (+{len(errors) - 1} more: run `tool validate {recipe.path}`)" if len(errors) > 1 else ""
            raise RecipeError(f"{errors[0]}{more}")
    return recipe

"""Find and load recipes: by id (from recipes/ or $KILN_RECIPES) or by path.

Loading here only parses JSON and locates the file; validation against the schema and
the rules beyond it lives in tool.validate. Commands that act on a recipe call
`load(ref)`, which validates it too, so nothing downstream sees an invalid recipe.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tool import REPO_ROOT
from tool.errors import RecipeError


def recipes_dirs() -> list[Path]:
    """Where recipes live: $KILN_RECIPES (os.pathsep-separated) first, then the repo's recipes/."""
    dirs = [Path(p) for p in os.environ.get("KILN_RECIPES", "").split(os.pathsep) if p]
    return dirs + [REPO_ROOT / "recipes"]


def recipe_files(dirs: list[Path] | None = None) -> list[Path]:
    out = []
    for d in dirs or recipes_dirs():
        if d.is_dir():
            out += sorted(p for p in d.rglob("*.json") if p.name != "schema.json")
    return out


@dataclass
class Recipe:
    path: Path
    data: dict = field(repr=False)
    raw: bytes = field(repr=False)

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def runtime(self) -> str:
        return self.data["runtime"]["kind"]

    def __getitem__(self, key):
        return self.data[key]

    def get(self, key, default=None):
        return self.data.get(key, default)


def parse(path: Path) -> Recipe:
    """Read and JSON-parse one recipe file; a one-line reason when that fails."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise RecipeError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a JSON object, not {type(data).__name__}")
    return Recipe(path, data, raw)


def index(dirs: list[Path] | None = None) -> dict[str, Path]:
    """id -> file, for every recipe that parses (invalid files are tool validate's business)."""
    out: dict[str, Path] = {}
    for p in recipe_files(dirs):
        try:
            rid = json.loads(p.read_bytes()).get("id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(rid, str) and rid not in out:
            out[rid] = p
    return out


def resolve(ref: str) -> Path:
    """A recipe id or a path → the file. Unknown ids get the close ones suggested."""
    p = Path(ref)
    if p.suffix == ".json" or os.sep in ref:
        if not p.is_file():
            raise RecipeError(f"{ref}: no such recipe file")
        return p
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
        from tool.validate import validate_recipe  # schema + rules beyond it
        errors = validate_recipe(recipe)
        if errors:
            more = f" (+{len(errors) - 1} more: run `tool validate {recipe.path}`)" if len(errors) > 1 else ""
            raise RecipeError(f"{errors[0]}{more}")
    return recipe


def all_recipes(validate: bool = False) -> list[Recipe]:
    return [load(str(p), validate=validate) for p in index().values()]

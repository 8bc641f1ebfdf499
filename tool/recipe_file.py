"""Recipe files: where they live and how one is read (bounded, strict JSON) into a Recipe.

The bottom of the recipe modules: tool.validate checks what this reads, and tool.recipes (the one
loader commands call) finds a recipe by id or path, reads it here and validates it there.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tool import REPO_ROOT
from tool.errors import RecipeError


def recipes_dirs() -> list[Path]:
    """Where recipes live: $KILN_RECIPES (os.pathsep-separated) first, then the repo's recipes/."""
    dirs = [Path(p) for p in os.environ.get("KILN_RECIPES", "").split(os.pathsep) if p]
    return dirs + [REPO_ROOT / "recipes"]


def real_path(path: Path) -> Path:
    """The path with symlinks resolved, as far as they resolve: a symlink loop is parse()'s to report,
    where Path.resolve() would raise RuntimeError."""
    return Path(os.path.realpath(path))


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


# What a recipe file may be. The bundled recipes are ~30 KB and 6 levels deep; the limits leave
# room for files carried inline and stop a hostile file long before it costs memory or a stack.
MAX_RECIPE_BYTES = 4 * 2**20
MAX_DEPTH = 64
TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep (a recipe is at most {MAX_DEPTH})"

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class _Refused(ValueError):
    """Raised from json's hooks: a value JSON allows but a recipe may not hold."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_recipe_bytes(path: Path) -> bytes:
    """The file's bytes, refusing anything but a regular file of at most MAX_RECIPE_BYTES.

    The kind is checked with stat before the file is opened (opening a FIFO for reading blocks until
    a writer comes; a device may never end), and again on the open descriptor, opened non-blocking,
    in case the path was swapped in between."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:  # ELOOP (a symlink loop), ENOENT, EACCES; ValueError: a NUL in the name
        raise RecipeError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise RecipeError(f"{path}: is {_kind(st.st_mode)}, not a recipe file (a regular JSON file)")
    if st.st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"{path}: {st.st_size} bytes; a recipe file is at most {MAX_RECIPE_BYTES} bytes")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise RecipeError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise RecipeError(f"{path}: is {_kind(mode)}, not a recipe file (a regular JSON file)")
        chunks, size = [], 0
        while size <= MAX_RECIPE_BYTES:
            chunk = os.read(fd, MAX_RECIPE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise RecipeError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if size > MAX_RECIPE_BYTES:
        raise RecipeError(f"{path}: more than {MAX_RECIPE_BYTES} bytes; a recipe file is at most that")
    return b"".join(chunks)


def _no_duplicate_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"key {json.dumps(key)} appears twice in one object (which one counts is ambiguous)")
        out[key] = value
    return out


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text[:40]} is out of range (a recipe's numbers are finite)")
    return value


def _no_constant(text: str):
    raise _Refused(f"{text} is not JSON (a recipe's numbers are finite)")


def _depth(data) -> int:
    """How deeply data nests (iteratively: a deep document must not cost a deep stack)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            stack += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return deepest


def decode(raw: bytes, where: str) -> dict:
    """A recipe's bytes → its object: strict UTF-8, strict JSON (no NaN, no duplicate keys), bounded depth."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise RecipeError(f"{where}: not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} (line {line})") from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_float=_finite, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise RecipeError(f"{where}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except _Refused as e:
        raise RecipeError(f"{where}: not valid JSON for a recipe: {e}") from None
    except RecursionError:  # deeper than the parser's stack: far past the limit
        raise RecipeError(f"{where}: {TOO_DEEP}") from None
    except ValueError as e:  # an integer beyond Python's int_max_str_digits
        digits = re.search(r"has (\d+) digits", str(e))
        size = f"an integer of {digits.group(1)} digits" if digits else "a number"
        raise RecipeError(f"{where}: not valid JSON for a recipe: {size} is out of range "
                          f"(the limit is {sys.get_int_max_str_digits()} digits; a recipe's integers fit in 64 bits)") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe is a JSON object, not {type(data).__name__}")
    if _depth(data) > MAX_DEPTH:
        raise RecipeError(f"{where}: {TOO_DEEP}")
    return data


def parse(path: Path) -> Recipe:
    """Read and JSON-parse one recipe file; a one-line reason when that fails."""
    raw = read_recipe_bytes(path)
    return Recipe(path, decode(raw, str(path)), raw)

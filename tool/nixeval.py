"""The one place that runs Nix: evaluate nix/lib's compiler on a recipe and return the plan.

Kiln's compiler lives in Nix (nix/lib) so the NixOS module and `tool materialise` cannot
disagree; this module only calls `nix-instantiate --eval --strict --json` and parses its
answer. Nothing is cached on disk: the plan is a pure function of the recipe and options.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tool import REPO_ROOT
from tool.errors import MissingDependency, RecipeError

INSTALL_HINT = "install Nix: `apt-get install nix-bin` on Debian, or see https://nixos.org/download"

# The recipe and options travel as a file path and a JSON string, never spliced into Nix code.
_EXPR = """
{ lib, recipeFile, optionsJSON }:
(import lib).compile {
  recipe = builtins.fromJSON (builtins.readFile recipeFile);
  options = builtins.fromJSON optionsJSON;
}
"""


def nix_lib_dir() -> Path:
    """nix/lib of this checkout, or $KILN_NIX_LIB (set by the Nix package, where the tool is installed)."""
    return Path(os.environ.get("KILN_NIX_LIB") or REPO_ROOT / "nix" / "lib")


def nix_instantiate() -> str:
    exe = shutil.which("nix-instantiate")
    if exe is None:
        raise MissingDependency(f"nix-instantiate not found (Kiln compiles recipes with Nix): {INSTALL_HINT}")
    return exe


def first_error_line(stderr: str) -> str:
    """Nix's own one-line reason: the first `error:` line, without the trace that follows it."""
    for line in stderr.splitlines():
        line = line.strip()
        if line.startswith("error:"):
            rest = line[len("error:"):].strip()
            if rest:
                return rest
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    return lines[0] if lines else "no message"


def evaluate(expr: str, args: dict[str, str], what: str) -> object:
    """Evaluate a Nix function expression applied to string args (--argstr); strict, as JSON."""
    cmd = [nix_instantiate(), "--eval", "--strict", "--json", "--expr", expr]
    for name, value in args.items():
        cmd += ["--argstr", name, value]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise MissingDependency(f"cannot run nix-instantiate ({e.strerror or e}): {INSTALL_HINT}") from None
    if proc.returncode != 0:
        raise RecipeError(f"{what}: Nix could not compile it: {first_error_line(proc.stderr)}")
    return json.loads(proc.stdout)


def compile_plan(recipe_file: str | os.PathLike, options: dict, recipe_id: str | None = None) -> dict:
    """recipe file + options → the plan nix/lib computes (see nix/lib/default.nix for its shape)."""
    recipe_file = Path(recipe_file).resolve()
    args = {
        "lib": str(nix_lib_dir().resolve()),
        "recipeFile": str(recipe_file),
        "optionsJSON": json.dumps({k: v for k, v in options.items() if v is not None}),
    }
    return evaluate(_EXPR, args, recipe_id or str(recipe_file))

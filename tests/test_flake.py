"""The flake's `lib` evaluated by real Nix (2.8 here) with nixpkgs replaced by an empty flake,
since nixpkgs cannot be fetched in CI: its plans must equal what `tool plan` gets from
nix-instantiate. Packages, apps, checks and the NixOS module need nixpkgs and are not evaluated here.

A flake in a git repository only sees tracked files, so the flake is evaluated from a temp
copy (a `path:` URL) of exactly the files it reads.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tool import nixeval
from tool.recipes import index

REPO = Path(__file__).resolve().parent.parent
EMPTY_FLAKE = REPO / "tests" / "fixtures" / "empty-flake"

pytestmark = pytest.mark.skipif(shutil.which("nix") is None, reason="Nix is not installed")


@pytest.fixture(scope="module")
def flake_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("flake")
    shutil.copy2(REPO / "flake.nix", root / "flake.nix")
    shutil.copytree(REPO / "nix", root / "nix")
    shutil.copytree(REPO / "recipes", root / "recipes")
    empty = tmp_path_factory.mktemp("empty-flake")
    shutil.copy2(EMPTY_FLAKE / "flake.nix", empty / "flake.nix")
    return root, empty


def nix_eval(flake_copy, attr: str) -> object:
    root, empty = flake_copy
    env = {**os.environ, "NIX_CONFIG": "experimental-features = nix-command flakes"}
    proc = subprocess.run(
        ["nix", "eval", "--json", "--override-input", "nixpkgs", f"path:{empty}", f"path:{root}#{attr}"],
        capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_flake_lib_plans_equal_nix_instantiate(flake_copy):
    plans = nix_eval(flake_copy, "lib.plans")
    ids = index()
    assert sorted(plans) == sorted(ids)
    for recipe_id, path in ids.items():
        # Both with nix/lib's defaults (uid/gid included): the same compiler, two front doors.
        assert plans[recipe_id] == nixeval.compile_plan(path, {}, recipe_id), recipe_id


def test_flake_lib_compiles_with_options(flake_copy):
    unit = nix_eval(flake_copy, 'lib.plans."glm-5.3-flash".units."kiln-glm-5.3-flash.service"')
    assert "-p 127.0.0.1:8000:30000" in unit and unit.startswith("[Unit]\n")


def test_flake_exposes_the_module_and_recipes(flake_copy):
    assert sorted(nix_eval(flake_copy, "lib.recipes")) == sorted(index())
    root, empty = flake_copy
    env = {**os.environ, "NIX_CONFIG": "experimental-features = nix-command flakes"}
    proc = subprocess.run(["nix", "eval", "--raw", "--override-input", "nixpkgs", f"path:{empty}",
                           f"path:{root}#nixosModules.default"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.endswith("module.nix"), proc.stderr


@pytest.mark.parametrize("path", ["flake.nix", "nix/module.nix", "nix/packages.nix"])
def test_nixpkgs_dependent_files_parse(path):
    """What needs nixpkgs cannot be evaluated here; it must at least be valid Nix."""
    proc = subprocess.run(["nix-instantiate", "--parse", str(REPO / path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

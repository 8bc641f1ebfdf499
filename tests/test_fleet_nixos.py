"""NixOS fleets: the flake's lib.fleet turns one fleet description into each host's NixOS module; two hosts'
configurations evaluated by the real NixOS module system (../shared/nixpkgs) hold exactly the units
`tool materialise --host` writes for those hosts (compared as tests/test_module.py compares one host's).
Nothing is built or deployed here: colmena/deploy-rs and activation are not run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.shared_nixpkgs import shared_nixpkgs
from tests.test_module import MORE_OPTIONS, fake_package, sections

REPO = Path(__file__).resolve().parent.parent
NIXPKGS = shared_nixpkgs()
FLEET = "smollm2-135m-rpc"
ADDRESSES = {"head": "10.0.0.1:50052", "worker-a": "10.0.0.2:50052", "worker-b": "10.0.0.3:50052"}

pytestmark = [
    pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="Nix is not installed"),
    pytest.mark.skipif(NIXPKGS is None, reason="../shared/nixpkgs (the NixOS module harness) is not beside the checkout"),
]


def nix_attrs(d: dict) -> str:
    return "{ " + " ".join(f'"{k}" = "{v}";' for k, v in d.items()) + " }"


def fleet_modules(recipe: str, addresses: dict) -> str:
    """kiln.lib.fleet, as the flake builds it, applied to one fleet description."""
    return (f"((import {REPO}/nix/fleet-modules.nix {{ module = {REPO}/nix/module.nix; "
            f"recipeFiles = (import {REPO}/nix/lib).recipeFilesIn {REPO}/recipes; }}) "
            f"{{ recipe = \"{recipe}\"; addresses = {nix_attrs(addresses)}; }})")


def host_units(host: str, packages: str) -> dict[str, str]:
    mods = f'[ {fleet_modules(FLEET, ADDRESSES)}."{host}" {MORE_OPTIONS} ({packages}) ]'
    proc = subprocess.run(["nix-instantiate", "--eval", "--strict", "--json", str(NIXPKGS / "eval-nixos.nix"),
                           "--arg", "modules", mods, "-A", "units"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {k: v for k, v in json.loads(proc.stdout).items() if k.startswith("kiln-")}


def materialised(tmp_path: Path, host: str, flags: list[str]) -> dict[str, str]:
    root = tmp_path / host
    argv = [sys.executable, "-c", "import sys; from tool.cli import entry; sys.argv[0] = 'tool'; entry()",
            "materialise", FLEET, "--root", str(root), "--host", host, *flags]
    argv += [f"--fleet-address={name}={where}" for name, where in ADDRESSES.items()]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return {p.name: p.read_text() for p in (root / "etc/systemd/system").iterdir()}


@pytest.mark.parametrize("host", ["head", "worker-b"])
def test_each_hosts_configuration_holds_exactly_its_tool_materialise_units(tmp_path, host):
    tool, engine = fake_package(tmp_path, "tool", ["tool"]), fake_package(tmp_path, "engine", ["engine"])
    llama = fake_package(tmp_path, "llama-cpp", ["llama-server", "rpc-server"])
    packages = (f"{{ services.kiln.package = {tool}; services.kiln.enginePackage = {engine}; "
                f"services.kiln.llamaCppPackage = {llama}; }}")
    got = host_units(host, packages)
    starter = f"kiln-{FLEET}-start.service"        # the module's starter, named for the recipe on every host
    assert starter in got
    got.pop(starter)
    want = materialised(tmp_path, host, [
        "--uid", "2960", "--gid", "2960", f"--tool-bin={tmp_path}/tool/bin/tool", f"--engine-bin={tmp_path}/engine/bin/engine",
        f"--llama-server-bin={tmp_path}/llama-cpp/bin/llama-server", f"--rpc-server-bin={tmp_path}/llama-cpp/bin/rpc-server"])
    assert sorted(got) == sorted(want)
    for name in want:
        assert sections(got[name], FLEET) == sections(want[name], FLEET), name
    if host == "worker-b":
        unit = got[f"kiln-{FLEET}-worker-b.service"]
        assert "rpc-server --host 10.0.0.3 --port 50052 --threads 1" in unit
        allow = [v for line in unit.splitlines() if line.startswith("IPAddressAllow=") for v in line[15:].split()]
        assert allow == ["10.0.0.1", "10.0.0.2", "10.0.0.3"] and "IPAddressDeny=any" in unit.splitlines()


def test_the_flakes_lib_fleet_gives_a_module_per_host(tmp_path):
    root = tmp_path / "flake"
    shutil.copy2(REPO / "flake.nix", root.mkdir() or root / "flake.nix")
    for name in ("nix", "recipes"):
        shutil.copytree(REPO / name, root / name)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy2(REPO / "tests" / "fixtures" / "empty-flake" / "flake.nix", empty / "flake.nix")
    env = {**os.environ, "NIX_CONFIG": "experimental-features = nix-command flakes"}
    run = lambda apply: subprocess.run(
        ["nix", "eval", "--json", "--override-input", "nixpkgs", f"path:{empty}", f"path:{root}#lib.fleet",
         "--apply", apply], capture_output=True, text=True, env=env)
    proc = run(f'f: builtins.mapAttrs (_: m: m.services.kiln.recipes."{FLEET}".host) '
               f'(f {{ recipe = "{FLEET}"; addresses.worker-a = "10.0.0.2:50052"; }})')
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"head": "head", "worker-a": "worker-a", "worker-b": "worker-b"}
    proc = run(f'f: f {{ recipe = "{FLEET}"; addresses.worker-c = "10.0.0.4:50052"; }}')
    assert proc.returncode == 1
    assert (f"kiln.lib.fleet: addresses name worker-c, not a host of {FLEET} (hosts: head, worker-a, worker-b)"
            in proc.stderr)

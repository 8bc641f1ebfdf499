"""The flake evaluated by real Nix (2.8 here). nixpkgs cannot be fetched in CI, so its input is replaced:
by an empty flake for `lib` (its plans must equal what `tool plan` gets from nix-instantiate), and by
../shared/nixpkgs (the real nixpkgs lib, a stand-in pkgs of fake derivations: nothing builds) for the
installables as a user types them: `nix run .#glm-5.3-flash` and friends, resolved by Nix's own
installable parser. The packages' Python side is checked against the versions nixpkgs ships
(tests/fixtures/nixpkgs-python-versions.json) with pythonRuntimeDepsCheck's rule, and the two packages'
wheels are built here to show that no file is in both.

A flake in a git repository only sees tracked files, so the flake is evaluated from a temp
copy (a `path:` URL) of exactly the files it reads.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.fixtures.shared_nixpkgs import shared_nixpkgs
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
    proc = subprocess.run(["nix", "eval", "--json", "--override-input", "nixpkgs", f"path:{empty}",
                           f"path:{root}#nixosModules.default.imports"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and [p.rsplit("-", 1)[1] for p in json.loads(proc.stdout)] == ["module.nix"], proc.stderr


# --- installables as typed, against the stand-in nixpkgs -------------------------------------------
NIXPKGS = shared_nixpkgs()
needs_nixpkgs = pytest.mark.skipif(NIXPKGS is None, reason="../shared/nixpkgs is not beside the checkout")


@pytest.fixture(scope="module")
def standin_flake(tmp_path_factory) -> Path:
    """The flake with what packages.nix puts in $src, and a copy of ../shared/nixpkgs (read-only in CI)."""
    root = tmp_path_factory.mktemp("flake-full")
    for name in ("flake.nix", "pyproject.toml"):
        shutil.copy2(REPO / name, root / name)
    for name in ("nix", "recipes", "tool", "engine"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    nixpkgs = tmp_path_factory.mktemp("nixpkgs")
    shutil.copytree(NIXPKGS, nixpkgs, dirs_exist_ok=True)
    for p in nixpkgs.rglob("*"):
        p.chmod(p.stat().st_mode | 0o200)
    return root, nixpkgs


def nix(standin_flake, *args) -> subprocess.CompletedProcess:
    root, nixpkgs = standin_flake
    env = {**os.environ, "NIX_CONFIG": "experimental-features = nix-command flakes"}
    return subprocess.run(["nix", *args, "--override-input", "nixpkgs", f"path:{nixpkgs}"],
                          capture_output=True, text=True, env=env, cwd=root)


TYPED = [("glm-5.3-flash", "container"), ("glm-5.3", "container"), ("smollm2-135m", "native")]


@needs_nixpkgs
@pytest.mark.parametrize("rid,kind", TYPED)
def test_installable_as_typed_is_the_recipes_runnable(standin_flake, rid, kind):
    root, _ = standin_flake
    # `nix build .#<id>` / `nix eval .#<id>…`: Nix splits on dots and tries packages, then legacyPackages.
    proc = nix(standin_flake, "eval", "--json", f"path:{root}#{rid}", "--apply",
               'd: { inherit (d) name; main = d.meta.mainProgram; '
               'bin = map (e: e.path.text) (builtins.filter (e: e.name == "bin/${d.meta.mainProgram}") d.stub.entries); }')
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["name"] == f"kiln-{rid}" and got["main"] == f"kiln-{rid}"
    (script,) = got["bin"]
    assert f"/bin/tool up {rid} \"$@\"" in script
    if kind == "container":
        assert "KILN_DOCKER_BIN=${KILN_DOCKER_BIN:-/nix/store/" in script and "-docker-" in script
        assert "/usr/bin/docker" not in script and "KILN_ENGINE_BIN" not in script
    else:
        assert "KILN_ENGINE_BIN=${KILN_ENGINE_BIN:-/nix/store/" in script and "kiln-engine" in script


# --- nix run / nix build / nix flake check for real, against a buildable stand-in --------------------
BUILDABLE = REPO / "tests" / "fixtures" / "nixpkgs-buildable"


@pytest.fixture(scope="module")
def buildable(standin_flake, tmp_path_factory) -> Path:
    """tests/fixtures/nixpkgs-buildable over a copy of ../shared/nixpkgs: the same lib, packages that build."""
    d = tmp_path_factory.mktemp("nixpkgs-buildable")
    for f in BUILDABLE.iterdir():
        shutil.copy2(f, d / f.name)
    _, nixpkgs = standin_flake
    shutil.copytree(nixpkgs, d / "standin")
    return d


def nix_build(standin_flake, buildable, *args, program_args=()) -> subprocess.CompletedProcess:
    root, _ = standin_flake
    # Offline, as root, no nixbld users: MACHINE.md's recipe for building a derivation that needs nothing.
    env = {**os.environ, "NIX_CONFIG": "experimental-features = nix-command flakes\nsandbox = false\n"
                                       "substituters =\nbuild-users-group =\n"}
    return subprocess.run(["nix", *args, "--override-input", "nixpkgs", f"path:{buildable}", *program_args],
                          capture_output=True, text=True, env=env, cwd=root, timeout=300)


@needs_nixpkgs
@pytest.mark.parametrize("rid,kind", TYPED)
def test_nix_run_as_typed_runs_tool_up(standin_flake, buildable, rid, kind):
    """`nix run .#<id> -- --once`, exactly as typed: Nix resolves the id, builds the runnable and runs it;
    the stand-in `tool` prints the argv and KILN_* environment it got."""
    root, _ = standin_flake
    proc = nix_build(standin_flake, buildable, "run", f"path:{root}#{rid}", program_args=("--", "--once"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"tool up {rid} --once"
    env = dict(line.split("=", 1) for line in lines[1:])
    if kind == "container":
        assert re.fullmatch(r"/nix/store/[0-9a-z]{32}-docker-[^/]+/bin/docker", env["KILN_DOCKER_BIN"]), env
        assert "KILN_ENGINE_BIN" not in env
    else:
        assert re.fullmatch(r"/nix/store/[0-9a-z]{32}-kiln-engine-[^/]+/bin/engine", env["KILN_ENGINE_BIN"]), env


@needs_nixpkgs
def test_nix_build_as_typed_gives_the_plan_units_and_runnable(standin_flake, buildable):
    root, _ = standin_flake
    proc = nix_build(standin_flake, buildable, "build", "--json", "--no-link", f"path:{root}#glm-5.3-flash")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = Path(json.loads(proc.stdout)[0]["outputs"]["out"])
    plan = json.loads((out / "plan.json").read_text())
    assert sorted(p.name for p in (out / "units").iterdir()) == sorted(plan["units"])
    for name, text in plan["units"].items():
        assert (out / "units" / name).read_text() == text
    assert (out / "bin" / "kiln-glm-5.3-flash").is_file()
    assert re.fullmatch(r"/nix/store/[0-9a-z]{32}-docker-[^/]+/bin/docker", plan["steps"]["serve"]["argv"][0])
    assert (out / "tmpfiles.d" / "kiln-glm-5.3-flash.conf").read_text() == "\n".join(plan["tmpfiles"]) + "\n"


@needs_nixpkgs
def test_nix_flake_check_passes_with_only_the_lib_warning_of_nix_2_8(standin_flake, buildable):
    """Every output checked and every check built. `lib` is the one output Nix 2.8 calls unknown; Nix >= 2.13
    lists it among the known community outputs (NixOS/nix#7606), and real nixpkgs needs Nix >= 2.18 anyway."""
    root, _ = standin_flake
    proc = nix_build(standin_flake, buildable, "flake", "check", f"path:{root}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [l for l in proc.stderr.splitlines() if l.startswith("warning:")
                and "lock file" not in l and "build-users-group" not in l]
    assert warnings == ["warning: unknown flake output 'lib'"]


# --- the Python packages against nixpkgs -----------------------------------------------------------
NIXPKGS_VERSIONS = json.loads((REPO / "tests/fixtures/nixpkgs-python-versions.json").read_text())["packages"]


def wheel_metadata(tmp_path: Path) -> str:
    """The built wheel's METADATA (setuptools' own prepare_metadata_for_build_wheel on a copy)."""
    src = tmp_path / "src"
    shutil.copy2(REPO / "pyproject.toml", src / "pyproject.toml") if src.exists() else None
    src.mkdir(exist_ok=True)
    shutil.copy2(REPO / "pyproject.toml", src / "pyproject.toml")
    for name in ("tool", "engine"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "meta"
    out.mkdir()
    code = ("import sys; from setuptools import build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=src)
    assert proc.returncode == 0, proc.stderr
    return (out / proc.stdout.strip().splitlines()[-1] / "METADATA").read_text()


@pytest.mark.parametrize("extra", [None, "engine"])
def test_every_requires_dist_is_satisfied_by_nixpkgs(tmp_path, extra):
    """nixpkgs' pythonRuntimeDepsCheck: every Requires-Dist whose marker holds must be met by the
    installed version. Applied here to the versions nixpkgs ships (the fixture names each file)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    shipped = {canonicalize_name(k): v["version"] for k, v in NIXPKGS_VERSIONS.items()}
    unmet, checked = [], 0
    for line in wheel_metadata(tmp_path).splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": extra or ""}):
            continue
        name = canonicalize_name(req.name)
        assert name in shipped, f"{req.name}: no nixpkgs version recorded in the fixture"
        checked += 1
        if not req.specifier.contains(shipped[name], prereleases=True):
            unmet.append(f"{req} not satisfied by version {shipped[name]}")
    assert unmet == [] and checked == (9 if extra is None else 19)      # pyproject.toml's dependencies (urllib3: the stream reader)


def test_the_packages_install_side_by_side(tmp_path):
    """Each package's postPatch (taken from nix/packages.nix) run on a copy, then a real wheel built: no file
    is in both, and each has exactly its own console script."""
    if NIXPKGS is None:
        pytest.skip("../shared/nixpkgs (the stand-in pkgs that evaluates nix/packages.nix) is not beside the checkout")
    expr = (f"let pkgs = import {NIXPKGS}/pkgs-standin.nix {{ }}; p = pkgs.callPackage {REPO}/nix/packages.nix {{ }}; "
            "in { tool = p.tool.stub.args.postPatch; engine = p.engine.stub.args.postPatch; }")
    proc = subprocess.run(["nix-instantiate", "--eval", "--strict", "--json", "--expr", expr], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    records = {}
    for name, script in json.loads(proc.stdout).items():
        src = tmp_path / name / "src"
        src.mkdir(parents=True)
        shutil.copy2(REPO / "pyproject.toml", src / "pyproject.toml")
        for pkg in ("tool", "engine"):
            shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(["bash", "-euc", script], cwd=src, check=True)
        wheels = tmp_path / name / "dist"
        build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                                "-w", str(wheels), str(src)], capture_output=True, text=True)
        assert build.returncode == 0, build.stderr
        (whl,) = wheels.glob("*.whl")
        with zipfile.ZipFile(whl) as z:
            files = {n for n in z.namelist() if ".dist-info/" not in n}
            scripts = [l for l in z.read(next(n for n in z.namelist() if n.endswith("entry_points.txt"))).decode().splitlines()
                       if "=" in l]
        records[name] = files
        assert [s.split("=")[0].strip() for s in scripts] == [name]
        assert all(f.startswith(f"{name}/") for f in files), sorted(files)[:5]
    assert records["tool"] and records["engine"] and not records["tool"] & records["engine"]


@pytest.mark.parametrize("path", ["flake.nix", "nix/module.nix", "nix/packages.nix"])
def test_nixpkgs_dependent_files_parse(path):
    """What needs nixpkgs cannot be evaluated here; it must at least be valid Nix."""
    proc = subprocess.run(["nix-instantiate", "--parse", str(REPO / path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_runnables_container_cli_reaches_tool_ups_plan(monkeypatch, tmp_path):
    """`nix run .#glm-5.3-flash` exports KILN_DOCKER_BIN=<nixpkgs' docker>; tool up compiles its plan with it
    (not /usr/bin/docker, which NixOS does not have). Without it the default stays `tool plan`'s."""
    from tool.plan import compile_plan, plan_options
    from tool.recipes import load
    from tool.state import Dirs

    recipe = load("glm-5.3-flash")
    monkeypatch.delenv("KILN_DOCKER_BIN", raising=False)
    plain = compile_plan(recipe, plan_options(Dirs.resolve(state_dir=tmp_path)))
    assert plain["steps"]["serve"]["argv"][0] == "/usr/bin/docker"
    monkeypatch.setenv("KILN_DOCKER_BIN", "/nix/store/0000000000000000000000000000dock-docker-28/bin/docker")
    nixed = compile_plan(recipe, plan_options(Dirs.resolve(state_dir=tmp_path)))
    assert {nixed["steps"][s]["argv"][0] for s in ("prepare", "verify", "serve")} == \
        {"/nix/store/0000000000000000000000000000dock-docker-28/bin/docker"}
    assert "/usr/bin/docker" not in json.dumps(nixed["units"])


def test_nixpkgs_follows_a_release_branch_and_the_lock_workflow_is_written_down():
    proc = subprocess.run(["nix-instantiate", "--eval", "--json", "--expr", f"(import {REPO}/flake.nix).inputs.nixpkgs.url"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"github:NixOS/nixpkgs/nixos-\d\d\.(05|11)", json.loads(proc.stdout))
    readme = (REPO / "README.md").read_text()
    assert "nix flake lock" in readme and 'inputs.kiln.inputs.nixpkgs.follows = "nixpkgs"' in readme


def _third_party_imports(package: str) -> set[str]:
    """Top-level modules imported anywhere under `package` (any depth, also inside functions)."""
    import ast
    names = set()
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("tool", "engine", "__future__")}


def test_every_import_of_the_tool_is_declared_and_every_declared_dependency_used():
    """pyproject's [project] dependencies are exactly the distributions tool/ imports (no undeclared
    httpx2, no unused requests): the Nix package gets these and nothing else."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    declared = {canonicalize_name(Requirement(r).name)
                for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    dists = md.packages_distributions()
    imported = {canonicalize_name(dists[m][0]) for m in _third_party_imports("tool") if m in dists}
    unknown = {m for m in _third_party_imports("tool") if m not in dists}
    assert unknown == set(), f"imported but not installed (undeclared): {unknown}"
    assert imported - declared == set(), "imported, not declared"
    assert declared - imported == set(), "declared, never imported"

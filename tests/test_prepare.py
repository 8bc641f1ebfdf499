"""`tool prepare`, run as the console script: the plan's prepare step (`engine pack-store`) in staging, the plan's
verify step (`engine verify-store`, O_DIRECT) on the result, publish by rename. Real engine, real files; the
weights are a tiny random Mixtral checkpoint (tests/fixtures/tiny_models.py) placed where `tool fetch` puts them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="plans are compiled by Nix")

REPO = Path(__file__).resolve().parents[1]
TOOL = str(Path(sys.executable).parent / "tool")
RECIPE = REPO / "tests" / "fixtures" / "recipes-e2e" / "tiny-moe.kiln.1k.json"
TINY = json.loads(RECIPE.read_text())


def tool(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([TOOL, *args], capture_output=True, text=True, env=env, timeout=180, cwd=REPO)


@pytest.fixture
def setup(tiny_checkpoint, tmp_path):
    recipes = tmp_path / "recipes" / "cpu" / "any"
    recipes.mkdir(parents=True)
    shutil.copy(RECIPE, recipes / RECIPE.name)
    state = tmp_path / "state"
    shutil.copytree(tiny_checkpoint("mixtral"), state / "models" / TINY["weights"]["dirname"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["KILN_RECIPES"] = str(tmp_path / "recipes")
    return env, state, state / "stores" / TINY["store"]["dirname"]


def snapshot(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


def test_prepare_publishes_a_verified_store_then_skips_then_force_rebuilds(setup):
    env, state, store = setup
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"tiny-moe: prepared: {store}: prepared, verified and published (")
    assert sorted(p.name for p in (store / "experts").iterdir()) == ["experts.bin", "manifest.json", "manifest.sha256"]
    assert [p.name for p in (state / "stores").iterdir()] == [store.name]        # no staging left
    first = snapshot(store)

    again = tool("prepare", "tiny-moe", "--state-dir", str(state), "--json", env=env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["status"] == "skipped"
    assert snapshot(store) == first

    inode = (store / "experts" / "experts.bin").stat().st_ino
    forced = tool("prepare", "tiny-moe", "--state-dir", str(state), "--force", env=env)
    assert forced.returncode == 0 and " prepared: " in forced.stdout, forced.stderr
    assert (store / "experts" / "experts.bin").stat().st_ino != inode            # a new store, renamed in
    assert snapshot(store)["experts/experts.bin"] == first["experts/experts.bin"]
    assert [p.name for p in (state / "stores").iterdir()] == [store.name]


def test_a_store_built_from_other_inputs_is_rebuilt_not_reused(setup):
    """The store records what it was built from; a recipe whose prepare step changed (here: the record
    order) gets a new store even though the old one still verifies."""
    env, state, store = setup
    assert tool("prepare", "tiny-moe", "--state-dir", str(state), env=env).returncode == 0
    marker = json.loads((store / ".kiln-prepared.json").read_text())
    assert marker["recipe"] == "tiny-moe" and len(marker["inputs"]) == 64
    assert json.loads((store / "experts" / "manifest.json").read_text())["order"] == "rows"

    path = Path(env["KILN_RECIPES"]) / "cpu" / "any" / RECIPE.name
    data = json.loads(path.read_text())
    data["steps"]["prepare"]["commands"][-1] += ["--order", "cols"]
    path.write_text(json.dumps(data, indent=2) + "\n")
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert r.returncode == 0, r.stderr
    assert "prepared, verified and published (rebuilt: the published store was built from other inputs" in r.stdout
    assert json.loads((store / "experts" / "manifest.json").read_text())["order"] == "cols"
    assert json.loads((store / ".kiln-prepared.json").read_text())["inputs"] != marker["inputs"]
    assert json.loads(tool("prepare", "tiny-moe", "--state-dir", str(state), "--json", env=env).stdout)["status"] == "skipped"


def test_a_failing_prepare_leaves_the_published_store_as_it_was(setup):
    env, state, store = setup
    assert tool("prepare", "tiny-moe", "--state-dir", str(state), env=env).returncode == 0
    before = snapshot(store)
    (state / "models" / TINY["weights"]["dirname"] / "model.safetensors").write_bytes(b"not a safetensors file")
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), "--force", env=env)
    assert r.returncode != 0
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tool: tiny-moe: prepare: `engine pack-store` exited ")
    assert snapshot(store) == before
    assert [p.name for p in (state / "stores").iterdir()] == [store.name]


def test_a_tampered_published_store_is_refused_not_silently_rebuilt(setup):
    env, state, store = setup
    assert tool("prepare", "tiny-moe", "--state-dir", str(state), env=env).returncode == 0
    data = store / "experts" / "experts.bin"
    with open(data, "r+b") as f:
        f.seek(4096 + 7)
        b = f.read(1)
        f.seek(4096 + 7)
        f.write(bytes([b[0] ^ 0x55]))
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert r.returncode == 8, r.stderr
    assert r.stderr.startswith(f"tool: {store}: the published store no longer verifies (") and r.stderr.count("\n") == 1
    assert r.stderr.rstrip().endswith("`tool prepare tiny-moe --force` rebuilds it")
    fixed = tool("prepare", "tiny-moe", "--state-dir", str(state), "--force", env=env)
    assert fixed.returncode == 0, fixed.stderr


def test_no_weights_is_one_line(setup):
    env, state, store = setup
    shutil.rmtree(state / "models")
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert r.returncode == 1
    assert r.stderr == (f"tool: {state / 'models' / TINY['weights']['dirname']}: no weights to prepare from "
                        f"(run `tool fetch tiny-moe`)\n")
    assert not store.exists()


def test_the_marker_records_the_manifests_sha256_and_an_edited_manifest_is_not_skipped(setup):
    """Issue 12 (7): the store manifest's own sha256 is kept beside the inputs hash. A manifest edited with its
    sidecar rewritten to match (here: the record order relabelled, which no hash of the records can see)
    passes `engine verify-store`, but not the skip."""
    import hashlib
    env, state, store = setup
    assert tool("prepare", "tiny-moe", "--state-dir", str(state), env=env).returncode == 0
    manifest = store / "experts" / "manifest.json"
    marker = json.loads((store / ".kiln-prepared.json").read_text())
    assert marker["metadata"] == {"experts/manifest.json": hashlib.sha256(manifest.read_bytes()).hexdigest()}

    doc = json.loads(manifest.read_text())
    doc["order"] = "cols"
    text = (json.dumps(doc) + "\n").encode()
    manifest.write_bytes(text)
    (store / "experts" / "manifest.sha256").write_text(f"{hashlib.sha256(text).hexdigest()}  manifest.json\n")
    r = tool("prepare", "tiny-moe", "--state-dir", str(state), env=env)
    assert r.returncode == 8 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert r.stderr.startswith(f"tool: {store}: the published store no longer verifies ({manifest}: sha256 ")
    assert "recorded in .kiln-prepared.json when the store was prepared (edited since)" in r.stderr

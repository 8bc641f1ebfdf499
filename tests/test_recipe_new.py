"""Bring your own file: `tool recipe new FILE.gguf --card CARD` writes a valid native recipe pinning the local file
by sha256; `tool fetch` copies it in and serves only a copy that hashes to the pin; `tool up` runs it on the CPU
(the console scripts, a real engine on 127.0.0.1, plans compiled by Nix).

The GGUF is a tiny random qwen3moe written in llama.cpp's layout (tests/fixtures/tiny_gguf.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.tiny_gguf import write_gguf

REPO = Path(__file__).resolve().parents[1]
TOOL = str(Path(sys.executable).parent / "tool")


def tool(*args, env: dict | None = None, timeout=300) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "HF_"))} | (env or {})
    return subprocess.run([TOOL, *args], capture_output=True, text=True, env=e, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def gguf(tiny_checkpoint, tmp_path_factory):
    return write_gguf(tiny_checkpoint("qwen3_moe", layers=2), tmp_path_factory.mktemp("byo") / "tiny-qwen.Q8_0.gguf",
                      qtype="Q8_0")


@pytest.fixture(scope="module")
def recipe(gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe") / "tiny.kiln.1k.json"
    r = tool("recipe", "new", str(gguf), "--card", "any", "--ctx", "1024", "--out", str(out))
    assert r.returncode == 0 and r.stdout.strip() == str(out), r.stderr
    return out


def test_the_recipe_pins_the_file_and_validates(recipe, gguf):
    import hashlib
    data = json.loads(recipe.read_text())
    w = data["weights"]
    assert w == {"source": "local", "path": str(gguf.resolve()), "sha256": hashlib.sha256(gguf.read_bytes()).hexdigest(),
                 "size_bytes": gguf.stat().st_size, "dirname": f"tiny-qwen-q8-0-{w['sha256'][:12]}"}
    assert data["store"]["records"] == 2 * 8 and data["serve"]["context"] == 1024
    assert data["steps"]["serve"]["args"][:3] == ["serve", "--model", "@weights@/tiny-qwen.Q8_0.gguf"]
    assert tool("validate", str(recipe)).returncode == 0


def test_a_file_that_is_no_model_is_one_line(tmp_path, tiny_checkpoint):
    bad = write_gguf(tiny_checkpoint("qwen3_moe", layers=2), tmp_path / "bad.gguf", architecture="qwen2")
    r = tool("recipe", "new", str(bad), "--card", "any", "--out", str(tmp_path / "r.json"))
    assert r.returncode == 3 and r.stderr.count("\n") == 1, r.stderr
    assert "architecture 'qwen2' is not one Kiln serves" in r.stderr and not (tmp_path / "r.json").exists()


def test_fetch_serves_only_a_copy_the_pin_covers(recipe, gguf, tmp_path):
    models = tmp_path / "models"
    r = tool("fetch", str(recipe), "--models-dir", str(models))
    assert r.returncode == 0, r.stderr
    copy = models / json.loads(recipe.read_text())["weights"]["dirname"] / gguf.name
    assert copy.read_bytes() == gguf.read_bytes()
    r = tool("verify", str(recipe), "--models-dir", str(models), "--weights-only")
    assert r.returncode == 0, r.stderr
    with open(copy, "r+b") as f:            # the served copy changed after the fetch: verify names it
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 0xFF]))
    r = tool("verify", str(recipe), "--models-dir", str(models), "--weights-only")
    assert r.returncode == 8 and f"{gguf.name}: sha256 mismatch" in r.stderr, r.stderr

    # A different file at the pinned path: refused by both digests, nothing published.
    other = json.loads(recipe.read_text())
    changed = tmp_path / "changed.gguf"
    shutil.copy(gguf, changed)
    with open(changed, "r+b") as f:
        f.seek(-10, 2)
        f.write(b"\xff" * 10)
    other["weights"] |= {"path": str(changed), "dirname": "changed"}
    other_path = tmp_path / "other.kiln.1k.json"
    other_path.write_text(json.dumps(other))
    r = tool("fetch", str(other_path), "--models-dir", str(models))
    assert r.returncode == 8 and "sha256 mismatch: expected" in r.stderr, r.stderr
    assert not (models / "changed").exists()


@pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="plans are compiled by Nix")
def test_tool_up_runs_the_gguf_recipe_on_the_cpu(recipe, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = tmp_path / "report.json"
    r = tool("up", str(recipe), "--once", "--state-dir", str(tmp_path / "state"), "--port", str(port),
             "--gates", "load", "--json", str(report), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["verdict"] == "pass" and rep["checks"]["gates"]["load"]["passed"]

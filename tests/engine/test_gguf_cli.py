"""`--model FILE.gguf` through the engine's commands: pack-store packs the file's own expert blocks, verify-store
and verify-model check against it, serve serves it over HTTP; a split set is one model; and each kind of bad
file is one line, exit BAD_MODEL (3), with nothing published and nothing listening.

The files are tiny GGUFs written in llama.cpp's layout by the gguf package (tests/fixtures/tiny_gguf.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cli import main
from engine.loader import load_model
from tests.fixtures.served import ready_engine
from tests.fixtures.tiny_gguf import write_gguf

ENGINE = str(Path(sys.executable).parent / "engine")     # the installed console script, as users run it
PROMPT = [5, 17, 200, 42, 99, 7, 311, 64]


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe", layers=2)


@pytest.fixture(scope="module")
def q8_gguf(qwen, tmp_path_factory):
    return write_gguf(qwen, tmp_path_factory.mktemp("q8") / "tiny-qwen.Q8_0.gguf", qtype="Q8_0")


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model.prefill(torch.tensor(PROMPT), slot=0, all_logits=True)


def _truncate(p: Path) -> Path:
    os.truncate(p, p.stat().st_size - 100)
    return p


def _drop_second_part(p: Path) -> Path:
    p.with_name(p.name.replace("-00001-of-", "-00002-of-")).unlink()
    return p


# case: (write_gguf keywords, what to do to the written file, what the line must say)
BAD = {
    "truncated": ({}, _truncate, "truncated"),
    "unknown-type": ({"edit": lambda n, a: a.astype(np.int8) if n == "blk.0.attn_q.weight" else a}, None,
                     "tensor blk.0.attn_q.weight is I8, a type Kiln does not read"),
    "unknown-architecture": ({"architecture": "qwen2"}, None, "architecture 'qwen2' is not one Kiln serves"),
    "shape-disagrees": ({"edit": lambda n, a: a[:-2] if n == "blk.0.attn_k.weight" else a}, None,
                        "tensor blk.0.attn_k.weight has shape [64, 30], the metadata says [64, 32]"),
    "split-part-missing": ({"split_max_tensors": 12}, _drop_second_part, "lacks bad-00002-of-"),
    "no-tokenizer": ({"tokenizer": False}, None, "no tokenizer in the file (tokenizer.ggml.tokens)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_file_is_one_line_exit_bad_model_and_nothing_published(case, qwen, tmp_path, capsys):
    kw, damage, says = BAD[case]
    path = write_gguf(qwen, tmp_path / "bad.gguf", **kw)
    if damage:
        path = damage(path)
    store = tmp_path / "store"
    for argv in (["verify-model", "--model", str(path)],
                 ["pack-store", "--model", str(path), "--store", str(store), "--quiet"],
                 ["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "1"],
                 ["serve", "--model", str(path), "--port", "0"]):
        capsys.readouterr()
        assert main(argv) == 3, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("engine: ") and says in err, (argv, err)
        assert "Traceback" not in err
    assert not store.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".store")]


def test_split_set_is_one_model(qwen, tmp_path):
    whole = write_gguf(qwen, tmp_path / "whole.gguf")
    first = write_gguf(qwen, tmp_path / "split.gguf", split_max_tensors=12)
    assert first.name == "split-00001-of-00003.gguf"
    torch.testing.assert_close(_logits(load_model(first, max_context=32)),
                               _logits(load_model(whole, max_context=32)), atol=0, rtol=0)


def test_pack_store_packs_the_files_own_blocks_and_serving_them_equals_memory(q8_gguf, tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["pack-store", "--model", str(q8_gguf), "--store", str(store), "--quiet", "--json"]) == 0
    assert '"quant": "q8_0"' in capsys.readouterr().out          # the file's Q8_0 blocks, no --quant needed
    assert main(["verify-store", "--store", str(store), "--model", str(q8_gguf), "--quiet"]) == 0
    assert main(["verify-model", "--model", str(q8_gguf)]) == 0
    out = capsys.readouterr().out
    import hashlib
    assert hashlib.sha256(q8_gguf.read_bytes()).hexdigest() in out and "qwen3moe model" in out
    with_store = _logits(load_model(q8_gguf, store_dir=store, max_context=32))
    in_memory = _logits(load_model(q8_gguf, max_context=32))       # the same blocks, dequantized at load
    torch.testing.assert_close(with_store, in_memory, atol=1e-4, rtol=0)


def test_engine_serve_serves_a_gguf_over_http(q8_gguf):
    """Served as typed, at the default --log-level info: the engine's own load lines (where the experts went) reach
    stderr beside uvicorn's."""
    p = subprocess.Popen([ENGINE, "serve", "--model", str(q8_gguf), "--port", "0", "--ctx", "256"],
                         stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with ready_engine(p) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny-qwen.Q8_0"]
            a = c.post("/v1/chat/completions", json={
                "model": "tiny-qwen.Q8_0", "messages": [{"role": "user", "content": "Name three primary colors."}],
                "max_tokens": 4, "ignore_eos": True}).json()
            assert a["usage"]["completion_tokens"] == 4
            # the chat template from the file: the prompt is the file's template applied, counted by its tokenizer
            from engine.gguf_model import GgufModel, load_tokenizer
            tok = load_tokenizer(GgufModel(q8_gguf))
            want = tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
            assert a["usage"]["prompt_tokens"] == len(want)
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert "Traceback" not in err, err
    assert "INFO:     engine.tiers: experts: memory (" in err, err

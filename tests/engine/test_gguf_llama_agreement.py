"""Kiln and llama.cpp agree on the same GGUF file, made by llama.cpp's own tools (issue 29).

A small random qwen3moe checkpoint (transformers, with the demo's tokenizer: llama.cpp's converter refuses a BPE
tokenizer it does not know) goes through llama.cpp's convert_hf_to_gguf.py to F32 and llama-quantize to Q4_K_M
(a mix: Q4_K, Q6_K for some ffn_down and attn_v) and Q6_K. Each file is served by llama-server and loaded by Kiln
alone; over ~100 teacher-forced positions Kiln's top-1 token is llama-server's, and their KL (over llama's top-20
and a rest bin: a lower bound) is small. Kiln's side is in-process (the LLM object `engine serve` serves): its
/v1/completions has no logprobs yet. The real tools and the real server, no double: where they are not built the
test skips naming the build (fails under KILN_REQUIRE_LLAMA_CPP=1). bench/gguf_agreement.py measures the full set.
"""
from __future__ import annotations

import os

import pytest

from engine.measure import gguf_agreement as ga

pytestmark = pytest.mark.slow      # converter (a torch+transformers child) + two quantizations + two servers: ~1-2 min


def _require_tools():
    from tests.fixtures.llama_server import require_llama_server
    exe = require_llama_server()
    missing = [p for p in (ga.quantize_bin(), ga.converter()) if not p.is_file()]
    if missing:
        why = f"no {', '.join(map(str, missing))} ($KILN_LLAMA_CPP_DIR); build them with `make llama-cpp`"
        if os.environ.get("KILN_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(why)
        pytest.skip(why)
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece")
    return exe


def test_kiln_agrees_with_llama_server_on_llama_quantize_files(tmp_path):
    from engine.llm import LLM
    from tests.fixtures.llama_server import LlamaServer
    from tests.fixtures.smollm2 import smollm2_gguf
    exe = _require_tools()
    tok = ga.tokenizer_from_gguf(smollm2_gguf(), tmp_path / "tok")
    ck = ga.random_moe_checkpoint("qwen3_moe", tmp_path / "ck", tmp_path / "tok", hidden=256, moe_inter=256,
                                  layers=2, experts=4, top_k=2)
    f32 = ga.convert_hf(ck, tmp_path / "F32.gguf")
    text = "A GGUF file alone is a model: config, tokenizer, chat template and every tensor from the file. " * 6
    ids = tok(text, add_special_tokens=False)["input_ids"][:101]
    assert len(ids) == 101
    for qtype in ("Q4_K_M", "Q6_K"):
        path = ga.quantize(f32, tmp_path / f"{qtype}.gguf", qtype)
        types = ga.tensor_types(path)
        assert {"Q4_K", "Q6_K"} <= set(types) if qtype == "Q4_K_M" else "Q6_K" in types, types
        with LlamaServer(path, exe=exe, ctx=512, threads=1) as srv:   # one thread: no barrier waits on a busy host
            top = ga.llama_topn(srv.url.removesuffix("/v1"), ids, 20)
        llm = LLM.load(path, max_context=512, max_batch=1, threads=2)
        try:
            kiln = ga.kiln_logprobs(llm, ids)
        finally:
            llm.close()
        r = ga.compare_topn(top, kiln, topn_is_reference=True)
        assert r["positions"] == 100
        assert r["top1_agreement"] >= 0.85, (qtype, r)     # random weights: near-ties (measured 0.92, KL 0.0002)
        assert r["kl_mean_nats_lower_bound"] <= 0.005, (qtype, r)   # a misread type gives KL of order 1

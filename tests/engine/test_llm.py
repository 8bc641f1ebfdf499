"""LLM: the generation API over real tiny checkpoints, with real threads as callers."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.cli import main as engine_main
from engine.llm import LLM, SamplingParams, Token

PROMPT = [5, 17, 200, 42, 99, 7, 311, 64, 128, 3, 250, 19]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    with LLM.load(tiny_checkpoint("qwen3_moe"), max_context=64, max_batch=3) as engine:
        yield engine


def ids(tokens: list[Token]) -> list[int]:
    return [t.id for t in tokens]


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "mixtral"])
def test_greedy_stream_equals_transformers_generate(arch, tiny_checkpoint):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                            pad_token_id=0)[0, len(PROMPT):].tolist()
    with LLM.load(tiny_checkpoint(arch), max_context=64, max_batch=2) as engine:
        out = engine.generate(PROMPT, GREEDY)
        assert engine.model_type == arch and engine.eos_token_ids
    assert ids(out) == want
    assert [t.finish for t in out] == [None] * 19 + ["length"]


def test_concurrent_streams_all_complete_with_their_own_tokens(llm):
    prompts = [PROMPT[:n] for n in (3, 5, 7, 9, 11, 12, 4)]     # 7 callers, 3 slots: some must queue
    alone = [ids(llm.generate(p, GREEDY)) for p in prompts]
    before = llm.counters()
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def caller(i):
        try:
            start.wait()
            results[i] = ids(llm.stream(prompts[i], GREEDY))
        except BaseException as e:      # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and sorted(results) == list(range(len(prompts)))
    assert [results[i] for i in range(len(prompts))] == alone
    after = llm.counters()
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 20 * len(prompts)
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == sum(map(len, prompts))
    assert after["active_streams"] == after["queued_streams"] == 0
    assert after["served"]["ram"] > before["served"]["ram"]       # the provider's counters are merged in


def test_seeded_sampling_is_reproducible_alone_or_batched(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    first = ids(llm.generate(PROMPT, params))
    assert ids(llm.generate(PROMPT, params)) == first
    assert ids(llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))) != first
    assert first != ids(llm.generate(PROMPT, GREEDY))[:16]
    # Alongside other streams, the seeded one draws the same tokens: its generator is its own.
    others = [llm.stream(PROMPT[:5], SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)) for _ in range(2)]
    mine = llm.stream(PROMPT, params)
    for g in others:
        next(g)                                 # submitted and running before the seeded one starts
    assert ids(list(mine)) == first
    assert all(len(list(g)) == 15 for g in others)


def test_tiny_top_p_is_greedy(llm):
    nucleus = SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=7, ignore_eos=True)
    assert ids(llm.generate(PROMPT, nucleus)) == ids(llm.generate(PROMPT, GREEDY))[:12]


def test_stop_ids_and_eos_end_the_stream_with_stop(llm):
    greedy = ids(llm.generate(PROMPT, GREEDY))
    stop_at = greedy[4]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=20, stop_token_ids=(stop_at,), ignore_eos=True))
    first = greedy.index(stop_at)
    assert ids(out) == greedy[:first + 1] and out[-1].finish == "stop"
    # The model's eos ids stop it unless ignore_eos: pose one of its greedy tokens as an eos id.
    llm.eos_token_ids.add(stop_at)
    try:
        assert llm.generate(PROMPT, SamplingParams(max_tokens=20))[-1] == Token(stop_at, "stop")
        assert len(llm.generate(PROMPT, GREEDY)) == 20
    finally:
        llm.eos_token_ids.discard(stop_at)


def test_context_limits(llm):
    with pytest.raises(ValueError, match="prompt is 64 tokens; the context is 64"):
        llm.stream([1] * 64, GREEDY)
    with pytest.raises(ValueError, match="prompt is 70 tokens; the context is 64"):
        llm.generate([1] * 70, GREEDY)
    # Prompt + output never exceeds the context: a 60-token prompt gets 4 tokens, the last "length".
    out = llm.generate([1] * 60, GREEDY)
    assert [t.finish for t in out] == [None, None, None, "length"]
    with pytest.raises(ValueError, match="token id 999 is outside the vocabulary"):
        llm.stream([1, 999], GREEDY)
    for bad, msg in [(dict(max_tokens=0), "max_tokens is 0"), (dict(temperature=-1), "temperature is -1"),
                     (dict(top_p=0.0), "top_p is 0.0")]:
        with pytest.raises(ValueError, match=msg):
            llm.stream(PROMPT, SamplingParams(**bad))


@pytest.mark.timeout(60)
def test_closing_a_stream_early_frees_its_slot(tiny_checkpoint):
    with LLM.load(tiny_checkpoint("qwen3_moe"), max_context=64, max_batch=1) as engine:
        for _ in range(3):                      # one slot: a leaked slot would block the next stream forever
            g = engine.stream(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
            next(g)
            g.close()
        assert len(engine.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))) == 5
        assert engine.counters()["active_streams"] == 0


def test_generate_command(tiny_checkpoint, capsys):
    model = str(tiny_checkpoint("glm4_moe"))
    assert engine_main(["generate", "--model", model, "--prompt", "The quick brown fox", "--max-tokens", "8",
                        "--chat", "--temperature", "0.7", "--seed", "3"]) == 0
    out = capsys.readouterr()
    assert "prompt tokens, 8 generated, finish=length" in out.err or "finish=stop" in out.err
    assert engine_main(["generate", "--model", model, "--prompt", "The quick brown fox " * 20, "--ctx", "16"]) == 2
    assert "the context is 16" in capsys.readouterr().err
    assert engine_main(["generate", "--model", model + "-missing", "--prompt", "x"]) == 3
    assert "config.json: missing" in capsys.readouterr().err

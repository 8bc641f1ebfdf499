"""LLM: the generation API over real tiny checkpoints, with real threads as callers."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.cli import main as engine_main
from engine.llm import LLM, Overloaded, RequestFailed, SamplingParams, Token
from tests.fixtures.callers import stream_together

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
    got = stream_together(llm, prompts, [GREEDY] * len(prompts))
    assert got == alone
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


# ---- one request's failure is its own --------------------------------------------------------------

def _run_beside_three(engine, bad_prompt, bad_params=GREEDY):
    """Three good streams and one bad one, overlapping: (the good ones' tokens, the bad one's outcome)."""
    good = [PROMPT[:n] for n in (5, 9, 12)]
    streams = [engine.stream(p, GREEDY) for p in good]
    firsts = [next(s) for s in streams]              # all three running before the bad one arrives
    bad = engine.stream(bad_prompt, bad_params)
    try:
        outcome = ids(list(bad))
    except RequestFailed as e:
        outcome = e
    return [[f.id] + ids(list(s)) for f, s in zip(firsts, streams)], outcome


@pytest.mark.parametrize("ahead", [False, True], ids=["step-by-step", "decode-ahead"])
@pytest.mark.parametrize("fault", ["prefill", "decode", "nan-logits"])
def test_a_failing_request_ends_alone_beside_three_streams(llm, monkeypatch, fault, ahead):
    """Fault injection (a test double where no real model fault can be provoked on demand): the real
    prefill/decode_step, wrapped to fail for the one sequence whose positions reach 45 (only the bad
    request's 45-token prompt gets there; the good ones stay below 33). Decoding ahead (forced on this CPU
    model, as in the decode-ahead tests below), a failure met by a step launched ahead ends the same request."""
    good = [PROMPT[:n] for n in (5, 9, 12)]
    alone = [ids(llm.generate(p, GREEDY)) for p in good]
    monkeypatch.setattr(llm, "_chain", ahead)
    real_prefill, real_decode = llm.model.prefill, llm.model.decode_step

    def prefill(ids_, slot, start=0, all_logits=False):
        if fault == "prefill" and len(ids_) == 45:
            raise RuntimeError("injected prefill fault")
        return real_prefill(ids_, slot, start, all_logits)

    def decode_step(tokens, slots, positions):
        if fault == "decode" and max(positions) >= 46:
            raise RuntimeError("injected decode fault")
        out = real_decode(tokens, slots, positions)
        if fault == "nan-logits":
            out[[i for i, p in enumerate(positions) if p >= 46]] = float("nan")
        return out

    monkeypatch.setattr(llm.model, "prefill", prefill)
    monkeypatch.setattr(llm.model, "decode_step", decode_step)
    before = llm.counters()["failed_requests_total"]
    got, bad = _run_beside_three(llm, [3] * 45)
    assert got == alone                                      # the three finished, token for token
    assert isinstance(bad, RequestFailed), bad
    assert str(bad).startswith(f"generation failed: {fault.split('-')[0].replace('nan', 'sampling')}")
    after = llm.counters()
    assert after["failed_requests_total"] == before + 1 and after["active_streams"] == 0
    monkeypatch.undo()
    assert ids(llm.generate(good[0], GREEDY)) == alone[0]      # and the engine serves on


@pytest.mark.parametrize("extreme", [dict(temperature=1e-40), dict(temperature=1.0, top_p=1e-300),
                                     dict(temperature=5e-324, top_p=5e-324)])
def test_sampling_extremes_are_greedy_beside_three_streams(llm, extreme):
    """What crashed every stream before (issue 12, finding 2): now greedy, and the neighbours untouched."""
    good = [PROMPT[:n] for n in (5, 9, 12)]
    alone = [ids(llm.generate(p, GREEDY)) for p in good]
    got, out = _run_beside_three(llm, PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, seed=3, **extreme))
    assert got == alone and out == ids(llm.generate(PROMPT, GREEDY))


def test_seeds_outside_64_bits_are_refused_eagerly(llm):
    with pytest.raises(ValueError, match="seed is 18446744073709551616; it must be an integer in"):
        llm.stream(PROMPT, SamplingParams(temperature=1.0, seed=2**64))


# ---- chunked prefill, the queue limit, abort --------------------------------------------------------

def test_chunked_prefill_equals_one_prefill(llm, tiny_checkpoint):
    model = llm.model
    with torch.inference_mode():
        whole = model.prefill(PROMPT, 0, all_logits=True)
        parts = [model.prefill(PROMPT[i:i + 5], 0, start=i, all_logits=True) for i in range(0, len(PROMPT), 5)]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-4)
    with LLM.load(tiny_checkpoint("qwen3_moe"), max_context=64, max_batch=3, chunk_size=4) as chunked:
        assert ids(chunked.generate(PROMPT, GREEDY)) == ids(llm.generate(PROMPT, GREEDY))


def test_a_long_prompt_is_prefilled_between_the_running_streams_steps(tiny_checkpoint, monkeypatch):
    """The scheduler's order, observed by wrapping the real prefill/decode_step: a 40-token prompt in
    chunks of 4 is ten prefill calls, and the running stream decodes between every two of them."""
    with LLM.load(tiny_checkpoint("qwen3_moe"), max_context=64, max_batch=2, chunk_size=4) as engine:
        calls = []
        real_prefill, real_decode = engine.model.prefill, engine.model.decode_step
        monkeypatch.setattr(engine.model, "prefill", lambda i, s, start=0, all_logits=False: (
            calls.append(("prefill", len(i))), real_prefill(i, s, start, all_logits))[1])
        monkeypatch.setattr(engine.model, "decode_step", lambda t, s, p: (
            calls.append(("decode", len(s))), real_decode(t, s, p))[1])
        running = engine.stream(PROMPT[:3], SamplingParams(max_tokens=40, ignore_eos=True))
        next(running)
        long = engine.generate(list(range(5, 45)), SamplingParams(max_tokens=2, ignore_eos=True))
        running.close()
        assert len(long) == 2
        chunks = [i for i, c in enumerate(calls) if c == ("prefill", 4)]
        assert len(chunks) == 10
        for a, b in zip(chunks, chunks[1:]):
            assert ("decode", 1) in calls[a + 1:b], calls[a:b + 1]    # the running stream got its step


def test_where_a_step_launches_asynchronously_its_tokens_go_out_after_the_next_launch(tiny_checkpoint, monkeypatch):
    """A CUDA resident model's decode_step returns before the GPU computes it (model.async_decode): the scheduler
    then hands a step's tokens to the sinks after launching the next step, so the server's per-token work runs
    while the GPU computes. No GPU here: the policy is forced on a CPU model (whose steps are synchronous, so it
    delivers at once by default), and the real steps' order against the real sink's deliveries is observed; the
    tokens, alone and beside a second stream, are the immediate path's."""
    with LLM.load(tiny_checkpoint("qwen3_moe"), max_context=64, max_batch=2) as engine:
        assert engine.model.async_decode is False and engine._defer is False
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        want = [ids(engine.generate(p, params)) for p in (PROMPT, PROMPT[:5])]
        monkeypatch.setattr(engine, "_defer", True)
        events: list = []
        real_decode = engine.model.decode_step
        monkeypatch.setattr(engine.model, "decode_step", lambda t, s, p: (events.append("launch"), real_decode(t, s, p))[1])
        got: list = []
        done = threading.Event()

        def sink(item):
            events.append("token")
            got.append(item)
            if isinstance(item, BaseException) or item.finish:
                done.set()
        engine.submit(PROMPT, params, sink=sink)
        assert done.wait(60)
        # t0 (from prefill) after launch 1, ..., t4 after launch 5; t5 ends the stream: no launch to wait for.
        assert events == ["launch", "token"] * 5 + ["token"], events
        assert ids(got) == want[0] and got[-1].finish == "length"
        streams = [engine.stream(p, params) for p in (PROMPT, PROMPT[:5])]
        assert [ids(list(s)) for s in streams] == want


# ---- decode ahead: the next greedy step launched from the device's argmax ---------------------------------
# On a GPU with every expert resident a step launches asynchronously (model.async_decode) and the engine decodes
# ahead by default. No GPU here: the policy is forced on a CPU model, whose steps are synchronous, so the tests
# hold the scheduler's bookkeeping (tokens, ends, joins, redone steps) to the step-by-step path; on the H200,
# tests/engine/test_gpu_path.py holds the graphed steps to it.

def test_decoding_ahead_gives_the_step_by_step_tokens_and_launches_before_reading(tiny_checkpoint, monkeypatch):
    with LLM.load(tiny_checkpoint("qwen3_moe"), max_context=64, max_batch=3) as engine:
        assert engine._chain is False                # a CPU step is synchronous: nothing to gain
        want = ids(engine.generate(PROMPT, GREEDY))
        stop = want[7]                               # a stop id that greedy decoding meets half way
        want_stopped = ids(engine.generate(PROMPT, SamplingParams(max_tokens=20, stop_token_ids=(stop,))))
        monkeypatch.setattr(engine, "_chain", True)
        events: list = []
        real_decode = engine.model.decode_step
        monkeypatch.setattr(engine.model, "decode_step", lambda t, s, p: (
            events.append(("launch", p[0], torch.is_tensor(t))), real_decode(t, s, p))[1])
        got: list = []
        done = threading.Event()

        def sink(item):
            events.append(("token", item.id))
            got.append(item)
            if item.finish:
                done.set()
        engine.submit(PROMPT, GREEDY, sink=sink)
        assert done.wait(60)
        assert ids(got) == want and got[-1].finish == "length"
        launches = [e for e in events if e[0] == "launch"]
        # One launch per position 12..30, each once: the steps launched ahead were all used. After the first,
        # each takes the previous step's argmax as a tensor, launched before that step's token went out (the
        # last too: the step before it does not end the stream).
        assert [p for _, p, _ in launches] == list(range(12, 31))
        assert [fed for _, _, fed in launches] == [False] + [True] * 18
        first_ahead = events.index(("launch", 13, True))
        assert events[first_ahead + 1] == ("token", want[1])     # t0 (prefill), launch 12, launch 13, then t1
        c = engine.counters()
        assert c["decode_ahead_steps_total"] == 18 and c["decode_ahead_redone_total"] == 0
        # A stop id ends the stream at the same token; the step launched past it is not used.
        stopped = ids(engine.generate(PROMPT, SamplingParams(max_tokens=20, stop_token_ids=(stop,))))
        assert stopped == want_stopped and stopped[-1] == stop and len(stopped) < 20
        assert engine.counters()["decode_ahead_redone_total"] == 1


def test_decoding_ahead_beside_joining_leaving_and_sampled_streams(llm, monkeypatch):
    """Seven callers on three slots (streams join and leave mid-batch), one of them sampled at a seed: every
    caller's tokens are the step-by-step path's, and steps launched ahead were both used and redone."""
    prompts = [PROMPT[:n] for n in (3, 5, 7, 9, 11, 12, 4)]
    lengths = [20, 7, 13, 20, 3, 16, 9]
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    params[4] = sampled
    alone = [ids(llm.generate(p, q)) for p, q in zip(prompts, params)]
    monkeypatch.setattr(llm, "_chain", True)
    before = llm.counters()
    assert stream_together(llm, prompts, params) == alone
    after = llm.counters()
    assert after["decode_ahead_steps_total"] > before["decode_ahead_steps_total"]
    assert after["active_streams"] == after["queued_streams"] == 0


def test_sampled_streams_decode_ahead_too_with_the_step_by_step_tokens(tiny_checkpoint, monkeypatch):
    """Seeded streams at temperature 1 with top-k/top-p/min-p: every step after the first launches from the ids
    sampled on the device, before the host reads them, and the tokens are the step-by-step path's. A penalised
    stream never chains (its counts follow the tokens read)."""
    specs = [SamplingParams(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True),
             SamplingParams(max_tokens=20, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=6, ignore_eos=True)]
    penalised = SamplingParams(max_tokens=10, temperature=1.0, seed=7, presence_penalty=1.0, ignore_eos=True)
    with LLM.load(tiny_checkpoint("qwen3_moe"), max_context=64, max_batch=3) as engine:
        want = [ids(engine.generate(PROMPT, q)) for q in specs]
        want_penalised = ids(engine.generate(PROMPT, penalised))
        monkeypatch.setattr(engine, "_chain", True)
        for q, w in zip(specs, want):
            fed: list = []
            real = engine.model.decode_step
            monkeypatch.setattr(engine.model, "decode_step", lambda t, s, p: (fed.append(torch.is_tensor(t)), real(t, s, p))[1])
            assert ids(engine.generate(PROMPT, q)) == w
            monkeypatch.setattr(engine.model, "decode_step", real)
            assert fed == [False] + [True] * 18      # each launch after the first took the sampled ids on the device
        before = engine.counters()["decode_ahead_steps_total"]
        assert ids(engine.generate(PROMPT, penalised)) == want_penalised
        assert engine.counters()["decode_ahead_steps_total"] == before


def test_a_full_queue_refuses_at_once_with_a_retry_time(tiny_checkpoint):
    with LLM.load(tiny_checkpoint("qwen3_moe"), max_context=64, max_batch=1, max_queue=1) as engine:
        running = engine.stream(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
        next(running)
        waiting = engine.stream(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
        with pytest.raises(Overloaded, match=r"the queue is full \(1 requests waiting for 1 running; the limit is 1\)") as e:
            engine.stream(PROMPT, GREEDY)
        assert e.value.retry_after >= 1 and engine.counters()["rejected_requests_total"] == 1
        running.close()
        assert len(list(waiting)) == 2                       # the queued one still runs
        assert len(engine.generate(PROMPT, SamplingParams(max_tokens=2))) <= 2   # and a seat is free again


def test_abort_ends_running_and_waiting_requests_then_serves_on(tiny_checkpoint):
    with LLM.load(tiny_checkpoint("qwen3_moe"), max_context=64, max_batch=1) as engine:
        running = engine.stream(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True))
        next(running)
        waiting = engine.stream(PROMPT, GREEDY)
        engine.abort("the server is shutting down")
        for s in (running, waiting):
            with pytest.raises(RequestFailed, match="the server is shutting down") as e:
                list(s)
            assert e.value.code == "shutting_down"
        assert len(engine.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))) == 3
        assert engine.counters()["active_streams"] == 0


# ---- the KV cache costs what is used, not what is reserved ------------------------------------------

def test_kv_cache_pages_are_not_touched_at_load(tiny_checkpoint):
    """RSS (/proc/self/statm) in a fresh process, around a second load (the first warms the libraries up:
    one slot, a short context) with a 64-slot × 4096 KV cache, and after a generation: the reserved bytes
    are not resident (zero-filling them made all 201 MB resident at once)."""
    import json
    import subprocess
    import sys
    script = (
        "import json, sys, torch\n"
        "from engine.llm import LLM, SamplingParams\n"
        "def rss():\n"
        "    with open('/proc/self/statm') as f: return int(f.read().split()[1]) * 4096\n"
        "warm = LLM.load(sys.argv[1], max_context=64, max_batch=1)\n"
        "warm.generate([5, 17, 200], SamplingParams(max_tokens=8, ignore_eos=True))\n"
        "a = rss()\n"
        "llm = LLM.load(sys.argv[1], max_context=4096, max_batch=64)\n"
        "b = rss()\n"
        "llm.generate([5, 17, 200], SamplingParams(max_tokens=8, ignore_eos=True))\n"
        "c = rss()\n"
        "print(json.dumps({'kv': llm.model.kv.nbytes, 'load': b - a, 'after_generate': c - a}))\n"
        "llm.close(); warm.close()\n")
    out = subprocess.run([sys.executable, "-c", script, str(tiny_checkpoint("qwen3_moe"))], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["kv"] == 2 * 3 * 64 * 4096 * 2 * 16 * 4          # k and v, layers, slots, positions, heads, dim, fp32
    assert m["load"] < m["kv"] / 8, m                      # zero-filling it would make it resident at once
    assert m["after_generate"] < m["kv"] / 8, m

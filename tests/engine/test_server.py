"""The OpenAI server over real HTTP: the real engine (LLM.load on tiny random checkpoints) behind a
real uvicorn on 127.0.0.1, spoken to with httpx. Random tiny models write arbitrary text, so
these tests check the plumbing (shapes, counts, streaming, errors, concurrency, cancellation);
the parsers' behaviour on real model-shaped text is tested in test_parsers.py."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.llm import LLM
from engine.server.app import create_app

WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_TURN = [
    {"role": "user", "content": "What's the weather in Paris right now? Use the tool."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"city":"Paris","temp_c":17,"sky":"overcast"}'}]
from tests.fixtures.served import Served, ready_engine  # noqa: E402

HI = [{"role": "user", "content": "Name three primary colors, comma separated."}]


@pytest.fixture(scope="module")
def qwen_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    with LLM.load(qwen_dir, max_context=512) as llm, Served(create_app(llm, served_name="tiny-qwen")) as s:
        s.llm = llm
        with httpx.Client(base_url=s.url, timeout=60) as c:
            s.client = c
            yield s


def sse_events(lines) -> list:
    """Parse an SSE body strictly: `data: …` lines separated by blank lines, ending with [DONE]."""
    events, lines = [], list(lines)
    assert lines, "empty stream"
    for i, line in enumerate(lines):
        if line == "":
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: "):]
        if data == "[DONE]":
            assert all(x == "" for x in lines[i + 1:]), "events after [DONE]"
            return events
        events.append(json.loads(data))
    raise AssertionError("the stream did not end with data: [DONE]")


def stream(client, path, body, **kw):
    with client.stream("POST", path, json={**body, "stream": True}, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def metric(client, name, labels=None) -> float:
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and (labels is None or all(s.labels.get(k) == v for k, v in labels.items())):
                return s.value
    raise AssertionError(f"{name} {labels or ''} not in /metrics")


def chat_prompt_len(llm, messages, tools=None) -> int:
    ids = llm.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---- models, tokenize, chat, completions ---------------------------------------------------------

def test_models_lists_the_served_name(qwen):
    r = qwen.client.get("/v1/models")
    assert r.status_code == 200
    (m,) = r.json()["data"]
    assert (m["id"], m["object"], m["owned_by"], m["max_model_len"]) == ("tiny-qwen", "model", "kiln", 512)
    assert qwen.client.get("/health").json() == {"status": "ready"}


def test_tokenize_prompt_and_messages_use_the_models_tokenizer(qwen):
    tok = qwen.llm.tokenizer
    r = qwen.client.post("/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert r["tokens"] == tok("The quick brown fox")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    r = qwen.client.post("/tokenize", json={"messages": TOOL_TURN, "tools": WEATHER_TOOL}).json()
    msgs = [{**m, "tool_calls": [{**m["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
            if m.get("tool_calls") else m for m in TOOL_TURN]
    assert r["count"] == chat_prompt_len(qwen.llm, msgs, WEATHER_TOOL)
    without_tools = qwen.client.post("/tokenize", json={"messages": TOOL_TURN}).json()["count"]
    assert r["count"] > without_tools                     # the tools went through the template


def test_chat_answer_shape_and_usage_counts(qwen):
    body = {"model": "tiny-qwen", "messages": HI, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    r = qwen.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    a = r.json()
    assert a["object"] == "chat.completion" and a["model"] == "tiny-qwen" and a["id"].startswith("chatcmpl-")
    assert a["system_fingerprint"].startswith("kiln-")
    (choice,) = a["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    assert a["usage"] == {"prompt_tokens": chat_prompt_len(qwen.llm, HI), "completion_tokens": 12,
                          "total_tokens": chat_prompt_len(qwen.llm, HI) + 12}
    assert a["usage"]["prompt_tokens"] == qwen.client.post("/tokenize", json={"messages": HI}).json()["count"]
    # The template opened <think>: what the model wrote up to </think> is reasoning; no tag leaks anywhere.
    msg = choice["message"]
    for text in (msg["content"] or "", msg["reasoning_content"] or ""):
        assert "<think>" not in text and "</think>" not in text and "<|im_end|>" not in text


def test_stream_is_well_formed_and_equals_the_whole_answer(qwen):
    body = {"messages": HI, "max_tokens": 24, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    whole = qwen.client.post("/v1/chat/completions", json=body).json()
    events = stream(qwen.client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    chunks, usage = events[:-1], events[-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length" and finishes[:-1] == [None] * (len(chunks) - 1)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    msg = whole["choices"][0]["message"]
    assert (reasoning or None, content) == (msg["reasoning_content"], msg["content"] or "")  # same seed, same answer
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    # without include_usage: no usage chunk
    events = stream(qwen.client, "/v1/chat/completions", {**body, "max_tokens": 3})
    assert all("usage" not in e for e in events) and events[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_text_and_token_ids(qwen):
    llm, c = qwen.llm, qwen.client
    ids = llm.tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    by_ids = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 10, "ignore_eos": True, "temperature": 0}).json()
    by_text = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True,
                                              "temperature": 0}).json()
    assert by_ids["object"] == "text_completion"
    assert by_ids["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 10, "total_tokens": len(ids) + 10}
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]   # same tokens in, same greedy text out
    assert by_ids["choices"][0]["finish_reason"] == "length"
    # the text is the engine's own greedy tokens, decoded
    from engine.llm import SamplingParams
    toks = llm.generate(ids, SamplingParams(max_tokens=10, ignore_eos=True))
    hidden = qwen.server.config.app.state.engine.hidden
    assert by_ids["choices"][0]["text"] == llm.tokenizer.decode([t.id for t in toks if t.id not in hidden])
    events = stream(c, "/v1/completions", {"prompt": ids, "max_tokens": 10, "ignore_eos": True, "temperature": 0})
    assert "".join(e["choices"][0]["text"] for e in events) == by_ids["choices"][0]["text"]
    # several prompts in one request: one choice each
    two = c.post("/v1/completions", json={"prompt": [ids, ids[:2]], "max_tokens": 4, "ignore_eos": True}).json()
    assert [ch["index"] for ch in two["choices"]] == [0, 1] and two["usage"]["completion_tokens"] == 8


def test_stop_strings_cut_the_answer(qwen):
    body = {"prompt": "The weather in Paris", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    full = qwen.client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    printable = [m.group() for m in re.finditer(r"[A-Za-z0-9 ,.]{2}", full[4:])]
    assert printable, f"no plain text to stop at in {full!r}"
    stop = printable[0]
    cut = qwen.client.post("/v1/completions", json={**body, "stop": [stop, "never-there"]}).json()
    assert cut["choices"][0]["text"] == full[:full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] < 40
    streamed = stream(qwen.client, "/v1/completions", {**body, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in streamed) == full[:full.index(stop)]


def test_tool_turn_renders_through_the_template(qwen):
    body = {"messages": TOOL_TURN, "tools": WEATHER_TOOL, "tool_choice": "auto", "max_tokens": 8, "temperature": 0}
    a = qwen.client.post("/v1/chat/completions", json=body).json()
    assert a["usage"]["prompt_tokens"] == qwen.client.post(
        "/tokenize", json={"messages": TOOL_TURN, "tools": WEATHER_TOOL}).json()["count"]
    assert a["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    for call in a["choices"][0]["message"].get("tool_calls") or []:     # a random model may even call it
        assert call["type"] == "function" and isinstance(json.loads(call["function"]["arguments"]), dict)


def test_glm_template_over_http(tiny_checkpoint):
    with LLM.load(tiny_checkpoint("glm4_moe"), max_context=512) as llm, \
            Served(create_app(llm, served_name="tiny-glm")) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        a = c.post("/v1/chat/completions", json={"messages": TOOL_TURN, "tools": WEATHER_TOOL, "max_tokens": 6,
                                                 "ignore_eos": True, "temperature": 0})
        assert a.status_code == 200, a.text
        a = a.json()
        # the assistant's JSON-string arguments reached GLM's template as a mapping (<arg_key>city…)
        msgs = [{**m, "tool_calls": [{**m["tool_calls"][0], "function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]}
                if m.get("tool_calls") else m for m in TOOL_TURN]
        assert a["usage"]["prompt_tokens"] == chat_prompt_len(llm, msgs, WEATHER_TOOL)
        text = llm.tokenizer.apply_chat_template(msgs, tools=WEATHER_TOOL, add_generation_prompt=True, tokenize=False)
        assert "<arg_key>city</arg_key><arg_value>Paris</arg_value>" in text
        assert a["usage"]["completion_tokens"] == 6


# ---- concurrency and cancellation ---------------------------------------------------------------

def test_many_clients_at_once_all_answered(qwen):
    async def one(client, seed):
        body = {"messages": HI, "max_tokens": 16, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        if seed % 2:                                        # half stream, half do not
            text = ""
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines()]
            for e in sse_events(lines):
                d = e["choices"][0]["delta"]
                text += (d.get("reasoning_content") or "") + (d.get("content") or "")
            return text
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        m = r.json()["choices"][0]["message"]
        return (m["reasoning_content"] or "") + (m["content"] or "")

    async def main():
        async with httpx.AsyncClient(base_url=qwen.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, seed) for seed in range(6)))

    answers = asyncio.run(main())
    assert len(answers) == 6 and len(set(answers)) == 6           # all answered, each its own seed
    assert metric(qwen.client, "kiln_requests_running") == 0
    assert metric(qwen.client, "kiln_requests_queued") == 0


def test_the_event_loop_stays_free_while_generating(qwen):
    result = {}

    def long_request():
        with httpx.Client(base_url=qwen.url, timeout=600) as c:    # this shared CPU can run ~4 tok/s
            result["r"] = c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 480, "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 20
    while metric(qwen.client, "kiln_requests_running") < 1:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.01)
    t0 = time.monotonic()
    assert qwen.client.post("/tokenize", json={"messages": HI}).status_code == 200
    assert qwen.client.get("/v1/models").status_code == 200
    assert time.monotonic() - t0 < 1.0 and t.is_alive()     # answered while the generation still runs
    t.join(120)
    assert result["r"].json()["usage"]["completion_tokens"] == 480


def test_client_disconnect_mid_stream_stops_its_generation(qwen):
    before = qwen.llm.counters()["generation_tokens_total"]
    body = {"messages": HI, "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}
    with qwen.client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):                                  # a few tokens arrive, then the client hangs up
            next(lines)
    deadline = time.monotonic() + 20
    while qwen.llm.counters()["active_streams"] or metric(qwen.client, "kiln_requests_running"):
        assert time.monotonic() < deadline, "the abandoned generation kept its slot"
        time.sleep(0.05)
    made = qwen.llm.counters()["generation_tokens_total"] - before
    time.sleep(0.3)
    assert qwen.llm.counters()["generation_tokens_total"] - before == made   # nothing more is generated
    assert made < 240, f"{made} of 480 tokens generated after the client left"    # a few, not the rest


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "Once"})])
def test_client_that_gives_up_on_a_whole_answer_stops_its_generation(qwen, path, body):
    before = qwen.llm.counters()["generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        qwen.client.post(path, json={**body, "max_tokens": 480, "ignore_eos": True}, timeout=0.3)
    left = qwen.llm.counters()["generation_tokens_total"]      # the client has hung up by now
    deadline = time.monotonic() + 20
    while qwen.llm.counters()["active_streams"]:
        assert time.monotonic() < deadline, "the abandoned generation kept its slot"
        time.sleep(0.05)
    end = qwen.llm.counters()["generation_tokens_total"]
    # Counted from the hang-up, not from the request: a fast host makes hundreds in the client's 0.3 s.
    assert end - left < 240, f"{end - left} tokens generated after the client left"
    assert end - before < 480, "the abandoned answer was generated to its end"


def test_metrics_move_with_requests(qwen):
    c = qwen.client
    names = ["kiln_generation_tokens_total", "kiln_prompt_tokens_total", "kiln_request_seconds_count",
             "kiln_time_to_first_token_seconds_count"]
    labels = [None, None, {"endpoint": "chat"}, {"endpoint": "chat"}]
    before = [metric(c, n, lab) for n, lab in zip(names, labels)]
    served_before = sum(metric(c, "kiln_expert_served_total", {"tier": t}) for t in ("gpu", "ram", "store"))
    a = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 5, "ignore_eos": True}).json()
    after = [metric(c, n, lab) for n, lab in zip(names, labels)]
    assert after[0] - before[0] == 5
    assert after[1] - before[1] == a["usage"]["prompt_tokens"]
    assert after[2] - before[2] == 1 and after[3] - before[3] == 1
    served = sum(metric(c, "kiln_expert_served_total", {"tier": t}) for t in ("gpu", "ram", "store"))
    assert served > served_before
    assert metric(c, "kiln_store_read_bytes_total") >= 0 and metric(c, "kiln_model_ready") == 1
    assert metric(c, "kiln_expert_provider", {"provider": "memory"}) == 1     # which provider serves the experts
    assert metric(c, "kiln_decode_graph_replays_total") == 0                   # the CPU decodes eagerly
    assert metric(c, "kiln_decode_ahead_steps_total") == 0                     # ... and step by step (engine.llm)
    assert metric(c, "kiln_decode_ahead_redone_total") == 0



def test_a_chats_next_turn_reuses_the_last_turns_positions(qwen):
    c = qwen.client
    first = [{"role": "system", "content": "You are a terse assistant who answers in one line. " * 3},
             {"role": "user", "content": "Name three primary colors, comma separated."}]
    a = c.post("/v1/chat/completions", json={"messages": first, "max_tokens": 6, "ignore_eos": True}).json()
    hits, reused = metric(c, "kiln_prefix_cache_hits_total"), metric(c, "kiln_prefix_cache_reused_tokens_total")
    second = first + [a["choices"][0]["message"], {"role": "user", "content": "And three secondary ones?"}]
    b = c.post("/v1/chat/completions", json={"messages": second, "max_tokens": 6, "ignore_eos": True}).json()
    assert metric(c, "kiln_prefix_cache_hits_total") == hits + 1
    assert metric(c, "kiln_prefix_cache_reused_tokens_total") - reused >= a["usage"]["prompt_tokens"] - 16
    assert b["usage"]["prompt_tokens"] > a["usage"]["prompt_tokens"]


# ---- errors ------------------------------------------------------------------------------------

BAD = [
    ("/v1/chat/completions", b'{"messages": [', None, "not valid JSON"),
    ("/v1/chat/completions", {}, "messages", "Field required"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "Input should be"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0", "needs content"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": -5}, "max_completion_tokens", "greater"),
    ("/v1/chat/completions", {"messages": HI, "model": "gpt-4"}, "model", "not served here"),
    ("/v1/chat/completions", {"messages": HI, "temperature": 2.5}, "temperature", "less than or equal to 2"),
    ("/v1/chat/completions", {"messages": HI, "temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ("/v1/chat/completions", {"messages": HI, "top_p": 0}, "top_p", "greater than 0"),
    ("/v1/chat/completions", {"messages": HI, "n": 2}, "n", "less than or equal to 1"),
    ("/v1/chat/completions", {"messages": HI, "top_k": -3}, "top_k", "greater than or equal to 0"),
    ("/v1/chat/completions", {"messages": HI, "min_p": 1.5}, "min_p", "less than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required", "tools": WEATHER_TOOL}, "tool_choice",
     "only 'auto' and 'none'"),
    ("/v1/chat/completions", {"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", "only text content parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]}, "messages",
     r"prompt is \d+ tokens; the context is 512"),
    ("/v1/completions", {"prompt": [1, 2, 99999], "max_tokens": 2}, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt", "empty"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "suffix is not supported"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "less than or equal to 20"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "only for echo"),
    ("/v1/completions", {"prompt": list(range(5, 105)) * 6}, "prompt", r"prompt is 600 tokens; the context is 512"),
    ("/tokenize", {"prompt": "a", "messages": HI}, None, "exactly one of"),
    ("/tokenize", {}, None, "exactly one of"),
]


@pytest.mark.parametrize("path,body,param,message", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_400_in_openai_shape(qwen, path, body, param, message):
    if isinstance(body, bytes):
        r = qwen.client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = qwen.client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert re.search(message, err["message"]), err["message"]
    assert err["param"] == param


def test_unknown_route_and_method_have_openai_bodies(qwen):
    r = qwen.client.post("/v1/embeddings", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert qwen.client.get("/v1/chat/completions").status_code == 405


def test_api_key(qwen_dir, qwen):
    with Served(create_app(qwen.llm, served_name="keyed", api_key="s3cret")) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.post("/v1/chat/completions", json={"messages": HI}, headers=headers).status_code == 401
            assert c.post("/tokenize", json={"prompt": "a"}, headers=headers).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=ok).json()["data"][0]["id"] == "keyed"
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=ok).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200   # probes stay open


# ---- loading ------------------------------------------------------------------------------------

def test_health_is_503_while_loading_then_ready(qwen_dir):
    release = threading.Event()

    def slow_load():                    # the app factory's loader seam, held until the test lets it go
        assert release.wait(30)
        return LLM.load(qwen_dir, max_context=128)

    with Served(create_app(loader=slow_load, served_name="slow")) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "loading"})
        r = c.get("/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        assert c.post("/v1/chat/completions", json={"messages": HI}).status_code == 503
        assert metric(c, "kiln_model_ready") == 0
        release.set()
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 128
        assert metric(c, "kiln_model_load_seconds") > 0


def test_health_is_500_with_the_reason_when_loading_fails(tmp_path):
    app = create_app(loader=lambda: LLM.load(tmp_path), served_name="broken")     # no checkpoint there
    with Served(app) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        deadline = time.monotonic() + 30
        while (r := c.get("/health")).status_code == 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert r.status_code == 500 and r.json()["status"] == "failed"
        assert str(tmp_path) in r.json()["error"]
        r = c.get("/v1/models")
        assert r.status_code == 500 and str(tmp_path) in r.json()["error"]["message"]


# ---- the `engine serve` command -----------------------------------------------------------------

ENGINE = str(Path(sys.executable).parent / "engine")     # the installed console script, as users run it


def engine_serve(*args, env=None):
    return subprocess.Popen([ENGINE, "serve", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def test_serve_command_end_to_end(qwen_dir, tmp_path):
    """The installed `engine serve`, on a packed store with a RAM tier of two experts, so the
    store is read while serving and /metrics shows it."""
    from engine.store.pack import pack_store
    store = tmp_path / "store"
    pack_store(qwen_dir, store)
    p = engine_serve("--model", str(qwen_dir), "--store", str(store), "--ram-slots", "2", "--readers", "1",
                     "--port", "0", "--ctx", "256", "--served-name", "cli-tiny", "--log-level", "warning",
                     env={"KILN_API_KEY": "k"})
    try:
        with ready_engine(p) as c:
            assert c.get("/v1/models").status_code == 401
            a = c.post("/v1/chat/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "cli-tiny", "messages": HI, "max_tokens": 3, "ignore_eos": True}).json()
            assert a["usage"]["completion_tokens"] == 3 and a["model"] == "cli-tiny"
            assert metric(c, "kiln_store_read_bytes_total") > 0
            assert metric(c, "kiln_expert_served_total", {"tier": "store"}) > 0
            assert metric(c, "kiln_expert_provider", {"provider": "tiered"}) == 1
            assert metric(c, "kiln_pcie_bytes_total") == 0                     # no GPU: nothing crosses PCIe
            assert metric(c, "kiln_writeback_bytes_total") == 0
            # per lane: the CPU computes every pick, the disk lane read them, nothing on the GPU or PCIe lanes
            assert metric(c, "kiln_lane_picks_total", {"lane": "cpu"}) > 0
            assert metric(c, "kiln_lane_bytes_total", {"lane": "disk"}) == metric(c, "kiln_store_read_bytes_total")
            assert metric(c, "kiln_lane_busy_seconds_total", {"lane": "disk"}) > 0
            assert metric(c, "kiln_lane_picks_total", {"lane": "gpu"}) == 0
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (as systemd expects)
    assert p.returncode == -signal.SIGTERM
    assert "Traceback" not in err, err


def test_serve_refuses_a_missing_model_dir_in_one_line(tmp_path):
    p = engine_serve("--model", str(tmp_path / "nope"))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3
    assert err.strip() == f"engine: {tmp_path / 'nope'}: no such model directory"


def test_serve_refuses_a_port_in_use_in_one_line(qwen_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p = engine_serve("--model", str(qwen_dir), "--port", str(port))
        out, err = p.communicate(timeout=60)
    assert p.returncode == 7
    assert err.strip() == f"engine: 127.0.0.1:{port} is in use"


def test_serve_stops_when_the_store_refuses_o_direct(qwen_dir, tmp_path):
    mnt = tmp_path / "ramfs"                # ramfs has no direct I/O: open(O_DIRECT) fails with EINVAL
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount ramfs here (needs root); tests/engine/test_store.py covers the probe")
    try:
        p = engine_serve("--model", str(qwen_dir), "--store", str(mnt), "--port", "0")
        _, err = p.communicate(timeout=60)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert p.returncode == 6
    assert err == f"engine: {mnt}: the filesystem refuses O_DIRECT (fstype ramfs)\n"


def test_requests_without_temperature_take_the_servers_default(qwen, tmp_path):
    """A request naming no temperature/top_p gets the server's default: the flag, else the model's
    generation_config.json, else OpenAI's 1.0 (vLLM takes the model's generation config the same way)."""
    from engine.server.endpoints import sampling_defaults
    assert sampling_defaults(None) == {"temperature": 1.0, "top_p": 1.0}
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95}')
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95}
    assert sampling_defaults(tmp_path, 0.0, None) == {"temperature": 0.0, "top_p": 0.95}
    with Served(create_app(qwen.llm, served_name="greedy", defaults={"temperature": 0.0, "top_p": 1.0})) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        body = {"model": "greedy", "messages": HI, "max_tokens": 12, "ignore_eos": True}
        a = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        b = c.post("/v1/chat/completions", json={**body, "seed": 123}).json()["choices"][0]["message"]
        assert a == b                                  # greedy: the seed changes nothing
        sampled = {json.dumps(c.post("/v1/chat/completions", json={**body, "temperature": 1.5, "seed": k}).json()
                              ["choices"][0]["message"]) for k in range(4)}
        assert len(sampled) > 1                        # the request's own temperature wins


def test_the_courier_hands_a_steps_tokens_to_the_loop_in_order_with_one_wake_up():
    """What the scheduler thread delivers while the loop is busy arrives in order, per queue, in one wake-up
    (a decode step of four streams costs the loop one wake, not four)."""
    from engine.server.generation import Courier

    async def main():
        loop = asyncio.get_running_loop()
        c, wakes = Courier(loop), []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))[1]
        queues = [asyncio.Queue() for _ in range(4)]

        def scheduler():                # a "step" of 4 streams, 3 times, while the loop is blocked
            for step in range(3):
                for i, q in enumerate(queues):
                    c.deliver(q, (step, i))
        t = threading.Thread(target=scheduler)
        t.start()
        t.join()                        # the loop ran nothing meanwhile
        got = [[await q.get() for _ in range(3)] for q in queues]
        assert got == [[(s, i) for s in range(3)] for i in range(4)]
        assert len(wakes) == 1
    asyncio.run(main())

"""`engine serve`'s stack over real HTTP on the CPU with a tiny random glm5_next checkpoint (the same one
tests/engine/test_glm5_next.py holds to transformers): chat and completions, streaming, concurrent sequences, a
stream cancelled while others go on, GLM's template with tool calls; greedy answers are the model's own greedy
tokens, so the scheduler's slots, chunked prefill and batched decode keep glm5_next's caches apart."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from engine.llm import LLM, SamplingParams
from engine.server.app import create_app
from tests.engine.test_server import TOOL_TURN, WEATHER_TOOL, sse_events, stream
from tests.fixtures.decode import greedy
from tests.fixtures.served import Served

HI = [{"role": "user", "content": "Name three primary colors, comma separated."}]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    ckpt = tiny_checkpoint("glm5_next")         # the checkpoint tests/engine/test_glm5_next.py holds to transformers
    # chunk_size 16: a 40-token prompt is prefilled in three chunks (prefill from a start > 0)
    # threads=1: tiny shapes, 2 shared cores (a second compute thread costs more than it computes here)
    with LLM.load(ckpt, max_context=512, max_batch=3, chunk_size=16, threads=1) as llm, \
            Served(create_app(llm, served_name="tiny-glm5")) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        s.llm, s.client = llm, c
        yield s


def test_completions_are_the_models_greedy_tokens_streamed_or_not(served):
    llm, c = served.llm, served.client
    ids = llm.tokenizer("The quick brown fox jumps over the lazy dog. " * 4, add_special_tokens=False)["input_ids"]
    assert len(ids) > 32
    whole = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "ignore_eos": True, "temperature": 0})
    assert whole.status_code == 200, whole.text
    whole = whole.json()
    assert whole["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}
    with torch.inference_mode():
        want, _ = greedy(llm.model, ids, 12, slot=2)
    got = llm.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [t.id for t in got] == want
    events = stream(c, "/v1/completions", {"prompt": ids, "max_tokens": 12, "ignore_eos": True, "temperature": 0})
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]


def test_chat_and_concurrent_streams_one_cancelled_half_way(served):
    async def one(client, seed):
        body = {"messages": HI, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if seed == 0 and len(lines) >= 10:         # this client hangs up half way
                    return None
        events = sse_events(lines)
        return "".join((e["choices"][0]["delta"].get("reasoning_content") or "")
                       + (e["choices"][0]["delta"].get("content") or "") for e in events)

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, s) for s in range(4)))

    answers = asyncio.run(main())
    whole = served.client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 24, "temperature": 0,
                                                            "ignore_eos": True})
    assert whole.status_code == 200, whole.text
    msg = whole.json()["choices"][0]["message"]
    alone = (msg["reasoning_content"] or "") + (msg["content"] or "")
    # greedy: every sequence that decoded beside the others (and beside the cancelled one) says what it says alone
    assert answers[0] is None and answers[1:] == [alone] * 3
    deadline = time.monotonic() + 20                  # the hang-up reaches the scheduler a moment later
    while served.llm.counters()["active_streams"]:
        assert time.monotonic() < deadline, "the cancelled sequence kept its slot"
        time.sleep(0.05)
    assert served.llm.model.caches.free_slots() == 3


def test_glm_template_renders_tool_calls(served):
    c, llm = served.client, served.llm
    a = c.post("/v1/chat/completions", json={"messages": TOOL_TURN, "tools": WEATHER_TOOL, "max_tokens": 4,
                                             "ignore_eos": True, "temperature": 0})
    assert a.status_code == 200, a.text
    assert a.json()["usage"]["completion_tokens"] == 4
    msgs = [{**m, "tool_calls": [{**m["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
            if m.get("tool_calls") else m for m in TOOL_TURN]
    text = llm.tokenizer.apply_chat_template(msgs, tools=WEATHER_TOOL, add_generation_prompt=True, tokenize=False)
    assert "<arg_key>city</arg_key><arg_value>Paris</arg_value>" in text


def test_an_image_in_a_message_is_refused_in_one_line(served):
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}], "max_tokens": 4}
    r = served.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # a checkpoint with a vision tower still serves text (its tower is left unread); images get one line
    assert "\n" not in err["message"] and "only text content parts" in err["message"], err
    assert err["param"] == "messages.0.content"

"""Logprobs in the API (issue 29), over real HTTP through the official `openai` client: the real engine (LLM.load on
a tiny random qwen3_moe checkpoint) behind a real uvicorn on 127.0.0.1, with the prefix cache on and off.

Every value is checked against Kiln's own logits for the same tokens, computed in-process from a second load of the
same checkpoint (the reference: prefill the prompt, then one decode step per token, as the engine runs a lone
request), log_softmax'ed here. The served engine prefills in chunks of 16 tokens, so a prompt's logprobs cross chunk
boundaries."""
from __future__ import annotations

import math

import openai
import pytest
import torch

from engine.llm import LLM, SamplingParams
from engine.server.app import create_app
from tests.fixtures.served import Served

CHUNK = 16
PROMPT = [5, 17, 200, 42, 9, 88, 301, 77, 12, 64, 250, 33, 8, 141, 99, 7, 120, 56, 3, 222, 45, 180, 61, 19, 90, 11,
          270, 38, 150, 72, 26, 13, 199]             # 33 tokens: three prefill chunks of 16
TOL = 1e-4          # the same model, the same path: equal up to fp32 rounding of a different batch layout


@pytest.fixture(scope="module")
def qwen_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def ref(qwen_dir):
    """The reference: the same checkpoint, its model driven directly (its scheduler never gets a request)."""
    with LLM.load(qwen_dir, max_context=512, max_batch=1, prefix_cache=False) as llm:
        yield llm


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-cache", "no-prefix-cache"])
def served(request, qwen_dir):
    with LLM.load(qwen_dir, max_context=512, max_batch=2, chunk_size=CHUNK, prefix_cache=request.param) as llm, \
            Served(create_app(llm, served_name="tiny")) as s:
        s.llm, s.prefix = llm, request.param
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield s


def ref_logprobs(llm, prompt: list[int], n_out: int, greedy_ids: list[int] | None = None):
    """(log_softmax of Kiln's logits at each answer position [n_out, V], the greedy ids) for `prompt`, feeding
    greedy_ids (or the argmax) back one decode step at a time."""
    m = llm.model
    with torch.inference_mode():
        rows = [m.prefill(prompt, 0).float()]
        ids = []
        for i in range(n_out):
            tok = greedy_ids[i] if greedy_ids is not None else int(rows[-1].argmax())
            ids.append(tok)
            if i + 1 < n_out:
                rows.append(m.decode_step([tok], [0], [len(prompt) + i])[0].float())
    return torch.log_softmax(torch.stack(rows), -1), ids


def ref_prompt_logprobs(llm, prompt: list[int]) -> torch.Tensor:
    """log_softmax of Kiln's logits over the whole prompt [T, V]: row p predicts prompt[p + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(llm.model.prefill(prompt, 0, all_logits=True).float(), -1)


def tok_text(llm, token_id: int) -> str:
    """A token's text as the tokenizer decodes it alone (a partial UTF-8 character as U+FFFD)."""
    return llm.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def decoded(llm, ids: list[int]) -> str:
    return llm.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat(s, **kw):
    base = dict(model="tiny", messages=[{"role": "user", "content": "Name three primary colors."}], max_tokens=8,
                temperature=0, extra_body={"ignore_eos": True})
    return s.client.chat.completions.create(**{**base, **kw})


def completion(s, **kw):
    base = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    return s.client.completions.create(**{**base, **kw})


def chat_prompt_ids(llm, messages) -> list[int]:
    from engine.server.chat import encode_chat
    return encode_chat(llm.tokenizer, messages)[1]


# ---- chat ---------------------------------------------------------------------------------------------------------

def test_chat_logprobs_equal_log_softmax_of_kilns_logits(served, ref):
    r = chat(served, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    ids = chat_prompt_ids(ref, [{"role": "user", "content": "Name three primary colors."}])
    want, greedy = ref_logprobs(ref, ids, 8)
    # the tokens' bytes are exact: together they are the answer's text, whatever characters they split
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace") == decoded(ref, greedy)
    for i, e in enumerate(content):
        assert e.token == tok_text(ref, greedy[i]) == bytes(e.bytes).decode("utf-8", errors="replace")   # greedy's
        assert math.isclose(e.logprob, float(want[i, greedy[i]]), abs_tol=TOL)
        vals, top_ids = torch.topk(want[i], 5)
        assert [t.token for t in e.top_logprobs] == [tok_text(ref, int(t)) for t in top_ids]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(vals.tolist(), abs=TOL)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].bytes == e.bytes and e.top_logprobs[0].logprob == e.logprob   # greedy = top-1


def test_chat_logprobs_without_top_and_off(served):
    r = chat(served, logprobs=True, max_tokens=4)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(e.top_logprobs == [] and e.logprob <= 0 for e in content)
    assert chat(served, max_tokens=2).choices[0].logprobs is None
    assert chat(served, max_tokens=2, logprobs=False).choices[0].logprobs is None


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)], ids=["greedy", "seeded"])
def test_chat_streamed_equals_not_streamed(served, sampling):
    kw = dict(logprobs=True, top_logprobs=3, max_tokens=10, **sampling)
    whole = chat(served, **kw).choices[0]
    parts, text = [], ""
    for ch in chat(served, stream=True, **kw):
        c = ch.choices[0]
        text += c.delta.content or ""
        if c.logprobs is not None:
            parts += c.logprobs.content
    assert text == whole.message.content
    assert [p.model_dump() for p in parts] == [p.model_dump() for p in whole.logprobs.content]
    for e in parts:                   # sampled tokens too: each is no likelier than the most likely one
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6


# ---- completions --------------------------------------------------------------------------------------------------

def test_completion_logprobs_equal_log_softmax_of_kilns_logits(served, ref):
    r = completion(served, logprobs=3)
    lp = r.choices[0].logprobs
    want, greedy = ref_logprobs(ref, PROMPT, 6)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for i in range(6):
        token = tok_text(ref, greedy[i])
        assert lp.tokens[i] == token
        assert math.isclose(lp.token_logprobs[i], float(want[i, greedy[i]]), abs_tol=TOL)
        vals, top_ids = torch.topk(want[i], 3)
        top = lp.top_logprobs[i]
        assert len(top) <= 4 and top[token] == lp.token_logprobs[i]      # the chosen token is always there
        expect: dict = {}
        for t, v in zip(top_ids.tolist(), vals.tolist()):
            expect.setdefault(tok_text(ref, t), v)
        assert top == pytest.approx(expect, abs=TOL)                      # greedy: the chosen one is among them
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_echo_with_max_tokens_0_returns_the_prompts_logprobs(served, ref):
    if served.prefix:               # the prompt's blocks are in a slot already: the echo must not reuse them
        completion(served, max_tokens=2)
        before = served.llm.counters()
    r = completion(served, echo=True, max_tokens=0, logprobs=2)
    (c,) = r.choices
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(PROMPT)
    want = ref_prompt_logprobs(ref, PROMPT)
    lp = c.logprobs
    assert len(lp.tokens) == len(PROMPT) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert c.text == decoded(ref, PROMPT)
    got = torch.tensor(lp.token_logprobs[1:])
    assert torch.allclose(got, want[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])], atol=TOL)
    for p in range(1, len(PROMPT)):
        vals, top_ids = torch.topk(want[p - 1], 2)
        expect: dict = {}
        for t, v in zip(top_ids.tolist(), vals.tolist()):   # a text two tokens share keeps the likelier's logprob
            expect.setdefault(tok_text(ref, t), v)
        expect.setdefault(tok_text(ref, PROMPT[p]), lp.token_logprobs[p])
        assert lp.top_logprobs[p] == pytest.approx(expect, abs=TOL)
    if served.prefix:
        after = served.llm.counters()
        assert after["prefix_cache_hits_total"] == before["prefix_cache_hits_total"]
        assert after["prefix_cache_lookups_total"] == before["prefix_cache_lookups_total"] + 1
        # and a plain request after it still reuses the prefix
        completion(served, max_tokens=2)
        assert served.llm.counters()["prefix_cache_hits_total"] == before["prefix_cache_hits_total"] + 1


def test_echo_with_an_answer_and_streamed_equals_not_streamed(served):
    kw = dict(echo=True, logprobs=1, max_tokens=5)
    whole = completion(served, **kw).choices[0]
    lp = whole.logprobs
    prompt_text = completion(served, echo=True, max_tokens=0).choices[0].text
    assert whole.text.startswith(prompt_text) and len(lp.tokens) == len(PROMPT) + 5
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset[len(PROMPT)] == len(prompt_text)             # the answer's offsets go on after the echo
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in completion(served, stream=True, **kw):
        c = ch.choices[0]
        text += c.text
        if c.logprobs is not None:
            for k in merged:
                merged[k] += getattr(c.logprobs, k)
    assert text == whole.text
    assert merged == {k: getattr(lp, k) for k in merged}


def test_echo_alone_streamed(served):
    chunks = list(completion(served, stream=True, echo=True, max_tokens=0, logprobs=0))
    texts = [c.choices[0].text for c in chunks]
    assert texts[-1] == "" and chunks[-1].choices[0].finish_reason == "length"
    lp = chunks[0].choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) and lp.token_logprobs[0] is None
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])               # logprobs 0: the chosen token alone


# ---- the engine: rows that ask beside rows that do not --------------------------------------------------------------

def test_engine_rows_that_ask_beside_rows_that_do_not(served, ref):
    """Two concurrent streams, one asking: only it gets logprobs, equal to the alone path's; the other's tokens are
    the ones it gets alone."""
    llm = served.llm
    plain_alone = [t.id for t in llm.generate(PROMPT[:9], SamplingParams(max_tokens=6, ignore_eos=True))]
    a = llm.stream(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    b = llm.stream(PROMPT[:9], SamplingParams(max_tokens=6, ignore_eos=True))
    got_a, got_b = list(a), list(b)
    assert [t.id for t in got_b] == plain_alone and all(t.logprob is None for t in got_b)
    want, greedy = ref_logprobs(ref, PROMPT, 6)
    assert [t.id for t in got_a] == greedy
    for i, t in enumerate(got_a):
        assert math.isclose(t.logprob.logprob, float(want[i, t.id]), abs_tol=1e-3)   # in a batch of two
        assert [i for i, _ in t.logprob.top] == torch.topk(want[i], 2).indices.tolist()
    assert got_a[0].prompt is None                  # no prompt logprobs asked


def test_params_out_of_range_are_refused_by_the_engine(served):
    for bad in (dict(logprobs=21), dict(logprobs=-1), dict(prompt_logprobs=True)):
        with pytest.raises(ValueError, match="from 0 to 20"):
            served.llm.stream(PROMPT, SamplingParams(**bad))


# ---- bad values: 400, one line ------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,kw,param,message", [
    (chat, dict(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
    (chat, dict(logprobs=True, top_logprobs=-1), "top_logprobs", "greater than or equal to 0"),
    (chat, dict(top_logprobs=2), "top_logprobs", "needs logprobs: true"),
    (chat, dict(logprobs=False, top_logprobs=0), "top_logprobs", "needs logprobs: true"),
    (chat, dict(extra_body={"logprobs": 3}), "logprobs", "valid boolean"),
    (completion, dict(logprobs=21), "logprobs", "less than or equal to 20"),
    (completion, dict(logprobs=-1), "logprobs", "greater than or equal to 0"),
    (completion, dict(max_tokens=0), "max_tokens", "only for echo"),
    (completion, dict(max_tokens=-1, echo=True), "max_tokens", "greater than or equal to 0"),
    (completion, dict(extra_body={"echo": "yes"}), "echo", "valid boolean"),
])
def test_bad_values_get_400_with_one_line(served, call, kw, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        call(served, **kw)
    err = e.value.body
    assert err["param"] == param and message in err["message"] and "\n" not in err["message"], err

"""The CUDA twin of test_logprobs.py, at the engine's level (the H200 has no fastapi/uvicorn): logprobs from decode
steps replayed from CUDA graphs with decode ahead on (what `engine serve --device cuda` runs), and prompt logprobs
from a CUDA prefill, against log_softmax of the same checkpoint's logits computed eagerly in-process. Rows that ask
keep decode ahead going: their table is computed on the device before the next step is launched."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [5, 17, 200, 42, 99, 7, 311, 64, 128, 3, 250, 19, 8, 9, 10, 11, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 77]
N = 24
TOL = 0.1           # bf16 graphs against bf16 eager steps: logits agree to bf16 rounding, not bit for bit


@pytest.fixture(scope="module")
def tiny_store(tiny_checkpoint, tmp_path_factory):
    from engine.store.pack import pack_store
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)
    store = tmp_path_factory.mktemp("tiny-store") / "store"
    pack_store(ck, store, dtype=torch.bfloat16)
    return ck, store


@pytest.fixture(scope="module")
def engines(tiny_store):
    from engine.llm import LLM
    ck, store = tiny_store
    with LLM.load(ck, store, device="cuda", max_context=256, max_batch=3, chunk_size=16) as served, \
            LLM.load(ck, store, device="cuda", max_context=256, max_batch=1, cuda_graphs=False, decode_ahead=False,
                     prefix_cache=False) as ref:
        assert served._chain and served.model.graphs is not None
        yield served, ref


def ref_logprobs(llm, prompt, ids):
    m = llm.model
    with torch.inference_mode():
        rows = [m.prefill(prompt, 0).float()]
        for i, tok in enumerate(ids[:-1]):
            rows.append(m.decode_step([tok], [0], [len(prompt) + i])[0].float())
    return torch.log_softmax(torch.stack(rows), -1)


def test_graph_decode_ahead_logprobs_equal_eager_log_softmax_and_keep_chaining(engines):
    from engine.llm import SamplingParams
    served, ref = engines
    served.generate(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))     # both runs below reuse one prefix
    plain = [t.id for t in served.generate(PROMPT, SamplingParams(max_tokens=N, ignore_eos=True))]
    before = served.counters()["decode_ahead_steps_total"]
    got = served.generate(PROMPT, SamplingParams(max_tokens=N, ignore_eos=True, logprobs=5))
    assert served.counters()["decode_ahead_steps_total"] - before == N - 2      # as without logprobs
    assert [t.id for t in got] == plain
    want = ref_logprobs(ref, PROMPT, plain)
    for i, t in enumerate(got):
        lp = t.logprob
        assert lp.top[0] == (t.id, lp.logprob)                                    # greedy = top-1
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert abs(lp.logprob - float(want[i, t.id])) < TOL
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), torch.topk(want[i], 5).values.cpu(), atol=TOL)


def test_sampled_rows_with_and_without_logprobs_draw_the_same_tokens(engines):
    from engine.llm import SamplingParams
    served, _ = engines
    p = dict(max_tokens=N, ignore_eos=True, temperature=1.0, seed=11)
    served.generate(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))     # both runs below reuse one prefix
    alone = [t.id for t in served.generate(PROMPT, SamplingParams(**p))]
    assert [t.id for t in served.generate(PROMPT, SamplingParams(**p, logprobs=2))] == alone
    # batched beside a row that does not ask (bf16 batches round differently: no token comparison here)
    a = served.stream(PROMPT, SamplingParams(**p, logprobs=2))
    b = served.stream(PROMPT[:12], SamplingParams(max_tokens=N, ignore_eos=True))
    got_a, got_b = list(a), list(b)
    assert len(got_a) == len(got_b) == N and all(t.logprob is not None for t in got_a)
    assert all(t.logprob is None for t in got_b)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "prefix-cached"])
def test_prompt_logprobs_from_a_cuda_prefill(engines, warm):
    from engine.llm import SamplingParams
    served, ref = engines
    if warm:                                  # its blocks are cached: the request must prefill them anyway
        served.generate(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    (first,) = served.generate(PROMPT, SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=2))
    assert len(first.prompt) == len(PROMPT) and first.prompt[0] is None
    with torch.inference_mode():
        want = torch.log_softmax(ref.model.prefill(PROMPT, 0, all_logits=True).float(), -1).cpu()
    for p in range(1, len(PROMPT)):
        lp = first.prompt[p]
        assert abs(lp.logprob - float(want[p - 1, PROMPT[p]])) < TOL
        assert len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]

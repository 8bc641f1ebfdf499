"""Prefix reuse for glm5_next (engine.prefix_cache over Glm5Caches' KDA state snapshots) on the tiny random
checkpoint in the published flat form (tests/fixtures/tiny_models.make_flat_glm5_next: the parts
tests/engine/test_glm5_next.py holds to transformers, written without transformers, whose glm5 config class
differs between versions: the H200's 5.17 refuses the nested form's layer types): a snapshot holds the states of exactly its
position; chat turns, prompts that branch mid-block, concurrent prompts with one system prompt and evictions give
the tokens and logprobs the engine gives with the prefix cache off, reusing exactly the tokens the snapshots allow;
/metrics counts it over real HTTP."""
from __future__ import annotations

import random
import threading

import httpx
import pytest
import torch

from engine.llm import LLM, SamplingParams, Token
from engine.loader import load_model
from engine.prefix_cache import BLOCK, PrefixCache
from engine.server.app import create_app
from tests.engine.test_glm5_next_cuda import no_tf32  # noqa: F401  (a fixture: TF32 off for exact CUDA matmuls)
from tests.fixtures.served import Served

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
ATOL = 1e-4


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(n)]


def ids(tokens: list[Token]) -> list[int]:
    return [t.id for t in tokens]


def same_output(got: list[Token], want: list[Token]) -> None:
    """Greedy tokens equal, and each position's top logprobs (the logits' log_softmax) within float tolerance."""
    assert ids(got) == ids(want)
    for g, w in zip(got, want):
        assert [t for t, _ in g.logprob.top] == [t for t, _ in w.logprob.top]
        torch.testing.assert_close(torch.tensor([lp for _, lp in g.logprob.top]),
                                   torch.tensor([lp for _, lp in w.logprob.top]), atol=ATOL, rtol=0)


def reused(llm: LLM) -> tuple[int, int]:
    c = llm.counters()
    return c["prefix_cache_hits_total"], c["prefix_cache_reused_tokens_total"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.fixtures.tiny_models import make_flat_glm5_next
    return make_flat_glm5_next(tmp_path_factory.mktemp("glm5_flat"))


@pytest.fixture(scope="module")
def engines(ckpt):
    # chunk_size 24: chunks that end mid-block, so snapshot positions fall inside chunks
    with LLM.load(ckpt, max_context=192, max_batch=3, chunk_size=24, threads=1) as cached, \
            LLM.load(ckpt, max_context=192, max_batch=3, prefix_cache=False, threads=1) as plain:
        yield cached, plain


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, max_context=96, max_batch=4)


def _states_after(model, seq: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA states a prefill of seq's first n tokens leaves (in a slot of its own)."""
    caches = model.caches
    other = caches.alloc()
    model.prefill(seq[:n], other)
    out = caches.state[:, other].clone(), caches.conv[:, other].clone()
    caches.release(other)
    return out


def test_a_snapshot_holds_the_states_of_exactly_its_position(model):
    """Prefill keeps the states at the boundary the prefix cache asks for (mid-prefill), decode at each boundary it
    crosses; each equals the states a prefill of exactly that many tokens leaves, and not one token either side."""
    caches = model.caches
    seq = prompt(1, 60)
    with torch.inference_mode():
        pc = PrefixCache(caches)                   # allocates the snapshots (prepare_reuse)
        slot, n = pc.admit(seq[:45])
        assert n == 0
        model.prefill(seq[:45], slot)              # one call, from 0 past 32: the prompt's last whole block
        for p in range(45, 50):                    # decode crosses 48
            model.decode_step([seq[p]], [slot], [p])
        kept = {p: (s.clone(), c.clone()) for p, (s, c) in caches.kept(slot).items()}
        assert sorted(kept) == [32, 48]
        for at in (32, 48):
            for want, got in zip(_states_after(model, seq, at), kept[at]):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            for off in (at - 1, at + 1):           # a snapshot a token early or late is another state
                assert (_states_after(model, seq, off)[0] - kept[at][0]).abs().max() > 1e-3
        pc.release(slot, seq[:50])


def test_a_running_slots_prefix_is_copied_with_its_snapshot(model):
    """Concurrent sharing: the prefix's latent and indexer rows and its snapshot go to the new slot, which then
    prefills the rest as the uncached forward does, and holds the snapshot itself once the source is gone."""
    caches = model.caches
    a = prompt(11, 40)
    b, c = a[:32] + prompt(12, 10), a[:32] + prompt(13, 10)
    with torch.inference_mode():
        pc = PrefixCache(caches)
        src, _ = pc.admit(a)
        model.prefill(a, src)
        pc.publish(src, a)                         # running: its prefix may be copied, not taken
        dst, n = pc.admit(b)
        assert dst != src and n == 32
        snap = caches.kept(src)[32]
        for live, kept, want in zip((caches.state[:, dst], caches.conv[:, dst]), caches.kept(dst)[32], snap):
            assert torch.equal(live, want) and torch.equal(kept, want)
        rest = model.prefill(b[32:], dst, start=32, all_logits=True)
        other = caches.alloc()
        whole = model.prefill(b, other, all_logits=True)
        caches.release(other)
        torch.testing.assert_close(rest, whole[32:], atol=ATOL, rtol=0)
        pc.release(src, None)                      # the source is gone (a failed step: nothing of it is kept)
        pc.release(dst, b)
        assert pc.admit(c) == (dst, 32)            # the copy's own snapshot serves the next one
        pc.release(dst, c)


def test_chat_turns_give_the_same_tokens_and_logprobs_reusing_the_last_reply(engines):
    cached, plain = engines
    hits, tokens = reused(cached)
    history, expect = prompt(2, 30), 0
    for turn in range(4):
        want = plain.generate(history, GREEDY)
        got = cached.generate(history, GREEDY)
        same_output(got, want)
        held = len(history) + len(got) - 1       # the last token is never fed back
        expect += held // BLOCK * BLOCK if turn < 3 else 0
        history = history + ids(got) + prompt(10 + turn, 9)
    # Each later turn resumes at the last block boundary of the last turn's prompt and reply (the reply's decode
    # kept it, or the prompt's prefill where the reply crossed none).
    assert reused(cached) == (hits + 3, tokens + expect)
    assert "prefix_cache_hits_total" not in plain.counters()
    assert plain.model.caches.snap_state is None            # --no-prefix-cache: no snapshot memory either


def test_a_prompt_branching_mid_block_reuses_only_up_to_a_snapshot(engines):
    cached, plain = engines
    a = prompt(3, 70)
    first = cached.generate(a, GREEDY)
    same_output(first, plain.generate(a, GREEDY))
    held = a + ids(first)[:11]                     # 81 positions; snapshots at 64 (prompt) and 80 (decode)
    cases = [(held + prompt(30, 9), 80),           # the whole reply: the decode's snapshot
             (held[:72] + prompt(31, 9), 64),      # branches at 72, inside the block from 64: back to 64
             (a[:40] + prompt(32, 20), 0),         # branches at 40: blocks up to 32 shared, but no snapshot there
             (a[:40] + prompt(33, 20), 32)]        # the previous one kept one at its branch point
    for p, n in cases:
        hits, tokens = reused(cached)
        same_output(cached.generate(p, GREEDY), plain.generate(p, GREEDY))
        assert reused(cached) == (hits + (n > 0), tokens + n), (len(p), n)


def test_concurrent_prompts_with_one_system_prompt_share_its_snapshot(engines):
    cached, plain = engines
    system = prompt(4, 40)                         # not block-aligned: its last whole block (32) is the branch point
    prompts = [system + prompt(40 + i, 20) for i in range(3)]
    alone = [plain.generate(p, GREEDY) for p in prompts]
    hits, tokens = reused(cached)
    first = cached.stream(prompts[0], SamplingParams(max_tokens=60, ignore_eos=True))
    next(first)                                    # prefilled and decoding: its slot holds the system prompt
    results: dict[int, list[Token]] = {}

    def caller(i):
        results[i] = cached.generate(prompts[i], GREEDY)
    threads = [threading.Thread(target=caller, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    first.close()
    for i in (1, 2):
        same_output(results[i], alone[i])
    # The first of the two finds the blocks but no snapshot in them and keeps one at 32; the second takes it from
    # that running sequence's slot (a copy: both were running).
    assert reused(cached) == (hits + 1, tokens + 32)


def test_evicted_prefixes_and_snapshots_leave_the_outputs_unchanged(ckpt):
    """Two slots, two chats and strangers between their turns: slots are taken from under the chats (LRU) and a
    slot's snapshots are replaced turn after turn; every answer is still the plain engine's."""
    with LLM.load(ckpt, max_context=192, max_batch=2, chunk_size=24, threads=1) as cached, \
            LLM.load(ckpt, max_context=192, max_batch=2, prefix_cache=False, threads=1) as plain:
        chats = {0: prompt(5, 20), 1: prompt(6, 26)}
        for turn in range(4):
            for c in (0, 1):
                got = cached.generate(chats[c], GREEDY)
                same_output(got, plain.generate(chats[c], GREEDY))
                chats[c] = chats[c] + ids(got) + prompt(50 + 2 * turn + c, 7)
            if turn == 1:                          # two strangers evict both chats' slots
                for s in (60, 61):
                    same_output(cached.generate(prompt(s, 33), GREEDY), plain.generate(prompt(s, 33), GREEDY))
        hits, _ = reused(cached)
        assert hits == 4                           # turns 1 and 3 of both chats: the strangers evicted turn 2's
        assert cached.counters()["prefix_cache_lookups_total"] == 10


def test_metrics_count_hits_and_reused_tokens_over_http(engines):
    cached, plain = engines
    base = prompt(7, 40)
    with Served(create_app(cached, served_name="tiny-glm5")) as s, httpx.Client(base_url=s.url, timeout=120) as c, \
            Served(create_app(plain, served_name="tiny-glm5")) as sp, \
            httpx.Client(base_url=sp.url, timeout=120) as cp:
        def metric(name: str) -> float:
            text = c.get("/metrics").text
            return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
                       or line.startswith(name + "_total "))
        before = metric("kiln_prefix_cache_hits"), metric("kiln_prefix_cache_reused_tokens")
        for p in (base, base + prompt(8, 10)):
            body = {"prompt": p, "max_tokens": 6, "ignore_eos": True, "temperature": 0, "logprobs": 2}
            got, want = c.post("/v1/completions", json=body), cp.post("/v1/completions", json=body)
            assert got.status_code == 200, got.text
            g, w = got.json()["choices"][0], want.json()["choices"][0]
            assert g["text"] == w["text"]
            torch.testing.assert_close(torch.tensor(g["logprobs"]["token_logprobs"]),
                                       torch.tensor(w["logprobs"]["token_logprobs"]), atol=ATOL, rtol=0)
        # the second prompt resumes at the first's last boundary: 45 held positions → 32
        assert (metric("kiln_prefix_cache_hits"), metric("kiln_prefix_cache_reused_tokens")) == \
            (before[0] + 1, before[1] + 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")
def test_on_cuda_a_decode_snapshot_behind_a_graph_replay_is_its_positions_states(ckpt, no_tf32):
    """The decode step replays a captured graph; the snapshot at the boundary it crosses is a copy queued behind
    the replay (Glm5Caches.after_decode), equal to the states a prefill to that position leaves."""
    model = load_model(ckpt, device="cuda", dtype="float32", max_context=96, max_batch=2, cuda_graphs=True)
    assert model.graphs is not None
    seq = prompt(14, 60)
    with torch.inference_mode():
        pc = PrefixCache(model.caches)
        slot, _ = pc.admit(seq[:40])
        model.prefill(seq[:40], slot)
        for p in range(40, 50):                    # crosses 48, every step a replay
            model.decode_step([seq[p]], [slot], [p])
        assert model.graphs.replays == 10
        kept = model.caches.kept(slot)[48]
        for want, got in zip(_states_after(model, seq, 48), kept):   # the fused kernels' rounding, not a token's
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert (_states_after(model, seq, 47)[0] - kept[0]).abs().max() > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")
def test_on_cuda_decode_snapshots_from_captured_graphs_resume_chat_turns(ckpt, no_tf32):
    """Decode replays CUDA graphs; the snapshots are device copies queued behind each replay (Glm5Caches.
    after_decode): chat turns resume from them and answer as the engine without the prefix cache."""
    # fp32, as the exactness tests are: in bf16 a prefill from a reused prefix rounds as another chunking does
    with LLM.load(ckpt, device="cuda", dtype="float32", max_context=192, max_batch=3, cuda_graphs=True) as cached, \
            LLM.load(ckpt, device="cuda", dtype="float32", max_context=192, max_batch=3, cuda_graphs=True,
                     prefix_cache=False) as plain:
        assert cached.model.graphs is not None, "the decode should replay graphs here"
        history, expect = prompt(9, 30), 0
        for turn in range(3):
            got = cached.generate(history, GREEDY)
            same_output(got, plain.generate(history, GREEDY))
            expect += (len(history) + len(got) - 1) // BLOCK * BLOCK if turn < 2 else 0
            history = history + ids(got) + prompt(70 + turn, 9)
        assert reused(cached) == (2, expect)
        assert cached.counters()["decode_graph_replays"] > 0

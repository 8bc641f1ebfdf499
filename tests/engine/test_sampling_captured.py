"""The sampler captured in CUDA graphs (engine.gpu.sampler_graph, engine.sampling.draw): what it draws equals the
eager sampler's (engine.sampling.sample) bit for bit, for every kind of row the API lets through; seeded rows draw
the same token in any batch; rows it cannot express (penalties) are left to the eager sampler.

On a CPU the SamplerGraphs object stages and draws eagerly (the staging, modes and views are the ones the GPU
captures); the CUDA twins at the end capture and replay the graphs for real, and run a whole engine with them."""
from __future__ import annotations

import random

import pytest
import torch

from engine.gpu.sampler_graph import SamplerGraphs
from engine.sampling import ARGMAX, GREEDY, PLAIN, TRUNCATE, Penalties, Picks, RowSpec, draw, mode, pack, sample

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (graph capture; run on the H200)")
V = 300


def random_row(rng: random.Random, index: int) -> RowSpec:
    kind = rng.choice(["greedy", "tiny", "plain", "top_p", "top_k", "min_p", "all"])
    t = {"greedy": 0.0, "tiny": 1e-6}.get(kind, rng.choice([0.3, 0.7, 1.0, 1.3, 2.0]))
    return RowSpec(t, top_p=rng.choice([0.5, 0.9]) if kind in ("top_p", "all") else 1.0,
                   top_k=rng.choice([1, 5, 40]) if kind in ("top_k", "all") else 0,
                   min_p=rng.choice([0.05, 0.3]) if kind in ("min_p", "all") else 0.0,
                   seed=rng.randrange(-2**63, 2**63), index=index)


def random_logits(rng: random.Random, b: int, device="cpu") -> torch.Tensor:
    x = torch.randn(b, V, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * rng.choice([0.5, 3, 10])
    for i in range(b):                          # the extremes: NaN never wins, +inf shares, a row with no finite logit
        odd = rng.random()
        if odd < 0.1:
            x[i, rng.randrange(V)] = float("nan")
        elif odd < 0.15:
            x[i, rng.randrange(V)] = x[i, rng.randrange(V)] = float("inf")
        elif odd < 0.18:
            x[i] = float("nan")
    return x.to(device)


def staged(sampler: SamplerGraphs, logits: torch.Tensor, rows: list[RowSpec]) -> torch.Tensor:
    how = sampler.stage(rows)
    assert how is not None
    return sampler.run(logits, how)


def eager(logits: torch.Tensor, rows: list[RowSpec]) -> torch.Tensor:
    ids, ok = sample(logits, rows)
    return torch.stack([ids, ok.long()])


def test_mode_picks_the_ops_sample_runs():
    g, t, p = RowSpec(0.0), RowSpec(1.0), RowSpec(0.8, top_p=0.9)
    assert mode([g, g]) == GREEDY and mode([g, t]) == PLAIN and mode([g, t, p]) == TRUNCATE
    assert mode([RowSpec(1e-7, top_k=3)]) == GREEDY                  # greedy by temperature: no setting matters
    pg, pt = RowSpec(0.0, repetition_penalty=1.2), RowSpec(1.0, presence_penalty=0.5)
    assert mode([g, pg]) == ARGMAX and mode([t, pt]) == PLAIN and mode([p, RowSpec(1.0, frequency_penalty=-1.0)]) == TRUNCATE
    assert mode([g, pg], penalties=False) is None and mode([t, pt], penalties=False) is None
    s = SamplerGraphs("cpu", max_batch=2)
    assert s.stage([t, pt]) is None                                    # penalised, and no counts to hand run()
    assert s.stage([t, pt], [0, 1], penalised=True) == PLAIN
    assert s.stage([t, t, t]) is None                                  # larger than the staging
    assert s.stage([t, p]) == TRUNCATE


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_penalised_batches_draw_and_record_what_the_eager_sampler_does(dev):
    """Penalised rows (repetition, presence, frequency; greedy and sampled) beside plain ones, over steps whose
    counts build up: the staged draw (on CUDA, the captured graphs' replays), reading and recording its own copy of
    the counts, gives sample()'s ids and leaves the same counts."""
    rng = random.Random(4)
    slots_n = 5
    mine, theirs = Penalties(slots_n, V, dev), Penalties(slots_n, V, dev)
    static = torch.zeros(4, V, device=dev)              # a decode graph's logits: one tensor, rewritten each step
    for slot in range(slots_n):
        prompt = [rng.randrange(V) for _ in range(8)]
        mine.reset(slot, prompt)
        theirs.reset(slot, prompt)
    s = SamplerGraphs(dev, max_batch=4)
    for step in range(30):
        b = rng.randint(1, 4)
        slots = rng.sample(range(slots_n), b)
        rows = [RowSpec(rng.choice([0.0, 0.8, 1.0]), top_k=rng.choice([0, 7]),
                        repetition_penalty=rng.choice([1.0, 1.3, 0.8]), presence_penalty=rng.choice([0.0, 0.5]),
                        frequency_penalty=rng.choice([0.0, -0.3, 1.0]), seed=rng.randrange(2**40), index=step)
                for _ in range(b)]
        x = random_logits(rng, b, dev)
        static[:b].copy_(x)
        how = s.stage(rows, slots, penalised=True)
        got = s.run(static[:b], how, mine).clone()
        ids, ok = sample(x, rows, penalties=theirs, slots=torch.tensor(slots, device=dev))
        assert torch.equal(got, torch.stack([ids, ok.long()])), (step, rows)
    assert torch.equal(mine.counts, theirs.counts) and torch.equal(mine.seen, theirs.seen)
    assert int(mine.counts.sum()) > 0


def test_the_staged_draw_equals_the_eager_sampler_bit_for_bit():
    """Random batches of every kind of row, through one staging buffer reused across batch sizes and modes (a
    stale setting from the last, larger batch would show): ids and finiteness equal sample()'s."""
    rng = random.Random(0)
    s = SamplerGraphs("cpu", max_batch=6)
    seen = set()
    for step in range(60):
        b = rng.randint(1, 6)
        rows = [random_row(rng, step) for _ in range(b)]
        x = random_logits(rng, b)
        seen.add(mode(rows))
        got = staged(s, x, rows)
        assert torch.equal(got, eager(x, rows)), (step, rows)
        floats, ints = pack(rows)
        assert torch.equal(torch.stack([t if i == 0 else t.long() for i, t in enumerate(draw(x, floats, ints, mode(rows)))]),
                           got)
    assert seen == {GREEDY, PLAIN, TRUNCATE}


def test_picks_from_the_staged_draw_read_like_the_eager_ones():
    """Picks(drawn=...) (what the captured path hands the scheduler) gives the host the same tokens and failures."""
    rng = random.Random(1)
    s = SamplerGraphs("cpu", max_batch=4)
    for step in range(20):
        rows = [random_row(rng, step) for _ in range(4)]
        x = random_logits(rng, 4)
        a = Picks(x, rows, drawn=staged(s, x, rows)).tokens()
        b = Picks(x, rows).tokens()
        assert [str(t) for t in a[0]] == [str(t) for t in b[0]] and a[1] == b[1]


def test_a_seeded_row_draws_the_same_token_in_any_batch_and_any_mode():
    """A sampled row's id depends on its logits, settings, seed and index alone: not on the batch's size, its place,
    or its neighbours' settings (a truncating neighbour sends the batch down the sorted path; this row keeps the
    plain draw)."""
    rng = random.Random(2)
    s = SamplerGraphs("cpu", max_batch=6)
    x = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 2
    for index in range(30):
        me = RowSpec(1.0, seed=1234, index=index)
        alone = int(staged(s, x[None], [me])[0, 0])
        b = rng.randint(2, 6)
        rows = [random_row(rng, index) for _ in range(b)]
        at = rng.randrange(b)
        rows[at] = me
        xs = random_logits(rng, b)
        xs[at] = x
        assert int(staged(s, xs, rows)[0, at]) == alone
        trunc = RowSpec(1.0, top_k=5, top_p=0.9, seed=1234, index=index)
        assert int(staged(s, x[None], [trunc])[0, 0]) == int(staged(s, torch.stack([xs[0], x]), [rows[0], trunc])[0, 1])


@needs_cuda
def test_on_cuda_the_captured_sampler_replays_the_eager_samplers_ids():
    rng = random.Random(3)
    s = SamplerGraphs("cuda", max_batch=6)
    static = torch.zeros(6, V, device="cuda")          # a decode graph's logits: one tensor, rewritten each step
    for step in range(120):
        b = rng.choice([1, 3, 6])
        rows = [random_row(rng, step) for _ in range(b)]
        x = random_logits(rng, b, "cuda")
        static[:b].copy_(x)
        got = staged(s, static[:b], rows).clone()
        assert torch.equal(got, eager(x, rows)), (step, rows)
    assert s.captures <= 3 * 3 and s.replays == 120     # one graph per (batch size, mode), replayed from then on


@needs_cuda
def test_on_cuda_seeded_sampled_streams_equal_the_eager_sampler_and_fall_back_for_penalties(tiny_checkpoint, tmp_path):
    """A whole engine on the GPU: temperature 1 seeded streams (plain and truncating), decoded from graphs with the
    captured sampler and decoding ahead, give the tokens of the engine without CUDA graphs (eager sampler, no
    decode ahead), and streams batched together run to their lengths; a penalised request is sampled in the sampler graph too (its slot's counts read and recorded there) and also
    equal."""
    from engine.llm import LLM, SamplingParams
    from engine.store.pack import pack_store
    ck = tiny_checkpoint("qwen3_moe", experts=16, top_k=4, layers=3)
    store = tmp_path / "store"
    pack_store(ck, store, dtype=torch.bfloat16)
    prompts = [[5, 17, 200, 42, 99, 7], [8, 9, 10, 11], [300, 1, 2, 3]]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=11),
              SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=20, seed=12),
              SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)]
    with LLM.load(ck, store, device="cuda", max_context=128, max_batch=3) as graphs, \
            LLM.load(ck, store, device="cuda", max_context=128, max_batch=3, cuda_graphs=False, decode_ahead=False) as plain:
        def alone(llm, ps):
            return [[t.id for t in llm.generate(p, q)] for p, q in zip(prompts, ps)]

        def together(llm, ps):
            its = [llm.stream(p, q) for p, q in zip(prompts, ps)]
            return [[t.id for t in it] for it in its]
        want = alone(plain, params)
        assert alone(graphs, params) == want
        # batched, the logits of a bf16 step depend on the batch (which steps batch whom depends on timing): lengths
        assert [len(t) for t in together(graphs, params)] == [20] * 3
        c = graphs.counters()
        assert c["decode_sampler_graph_replays"] >= 3 * 19 and c["decode_ahead_steps_total"] > 0
        pen = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=5, repetition_penalty=1.3,
                              presence_penalty=0.5, frequency_penalty=0.5)]
        before = graphs.counters()["decode_sampler_graph_replays"]
        assert alone(graphs, pen) == alone(plain, pen)
        assert graphs.counters()["decode_sampler_graph_replays"] == before + 11

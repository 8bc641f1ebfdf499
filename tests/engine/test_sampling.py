"""engine.sampling: the extremes the API lets through (every value below was a NaN/crash once), the draw's
distribution against the exact softmax and torch.multinomial (chi-square), and seeds that reproduce alone or in any
batch. The same sampler runs on the GPU; the CUDA twins at the end run there."""
from __future__ import annotations

import math
import random

import pytest
import torch

from engine.sampling import Penalties, RowSpec, SamplingError, check_params, choose, greedy_row, sample

V = 50


def logits(seed=0):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def draw(x, t, top_p=1.0, seed=0, **kw):
    return choose(x[None], [RowSpec(t, top_p, seed=seed, **kw)])[0]


@pytest.mark.parametrize("t", [1e-40, 1e-39, 1e-30, 1e-8, 5e-324])
def test_temperature_towards_zero_is_greedy(t):
    x = logits()
    for s in range(5):
        assert draw(x, t, seed=s) == int(x.argmax())


def test_small_temperatures_that_still_sample_never_divide_to_nan():
    x = logits()
    for t in (1e-4, 1e-3, 0.01):         # (x - max) / t: the best token weighs exactly 1, the rest underflow
        assert draw(x, t) == int(x.argmax())


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45, 1e-9])
def test_tiny_top_p_keeps_the_most_likely_token(top_p):
    x = logits(3)
    assert draw(x, 1.5, top_p) == int(x.argmax())


def test_nan_logits_never_win_and_inf_logits_share_the_draw():
    x = logits(1)
    x[7] = float("nan")
    best = int(torch.nan_to_num(x, nan=-1e9).argmax())
    assert draw(x, 0.0) == best                    # argmax alone would pick the NaN
    assert draw(x, 1e-6) == best
    assert draw(x, 1.0, 0.5) != 7
    x[11] = x[13] = float("inf")
    assert {draw(x, 1.0, seed=s) for s in range(40)} == {11, 13}
    assert draw(x, 0.0) in (11, 13)


def test_a_row_without_a_finite_logit_fails_alone():
    x = torch.stack([logits(0), torch.full((V,), float("nan")), logits(2), torch.full((V,), float("-inf"))])
    out = choose(x, [RowSpec(0.0), RowSpec(0.0), RowSpec(1.0, seed=0), RowSpec(0.7, seed=1)])
    assert out[0] == int(x[0].argmax()) and isinstance(out[2], int)
    assert isinstance(out[1], SamplingError) and isinstance(out[3], SamplingError)
    assert "no finite logit" in str(out[1])


def test_greedy_choice_is_greedy_row_on_every_kind_of_row():
    """choose's one-pass greedy (the row's argmax where its largest logit is finite) against greedy_row, row by row:
    plain, ties (the first wins), some -inf (masked tokens), a NaN, +inf, all -inf."""
    rows = [logits(0), logits(1), logits(2), logits(3), logits(4), torch.full((V,), float("-inf"))]
    rows[1][[4, 9]] = 50.0
    rows[2][::2] = float("-inf")
    rows[3][5] = float("nan")
    rows[4][30] = float("inf")
    x = torch.stack(rows)
    out = choose(x, [RowSpec(0.0)] * len(rows))
    assert out[1] == 4
    for row, got in zip(rows[:-1], out):
        assert got == greedy_row(row)
    assert isinstance(out[-1], SamplingError)


# ---- the draw's distribution ---------------------------------------------------------------------

N = 20000
CHI2_999 = {9: 27.88, 49: 85.35}       # chi-square's 99.9th percentile at 9 and 49 degrees of freedom


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts against probs, cells of expectation < 5 pooled; (stat, degrees of freedom)."""
    exp = probs * counts.sum()
    big = exp >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum()[None].double()])
    e = torch.cat([exp[big].double(), exp[~big].sum()[None].double()])
    obs, e = obs[e > 0], e[e > 0]
    return float(((obs - e) ** 2 / e).sum()), len(e) - 1


def draws(x: torch.Tensor, spec: dict, device="cpu") -> torch.Tensor:
    """N draws from row x, each a different request seed (rows of one batch), through the sampler."""
    rows = [RowSpec(seed=s, **spec) for s in range(N)]
    tokens, ok = sample(x.to(device)[None].expand(N, -1), rows)
    assert bool(ok.all())
    return torch.bincount(tokens.cpu(), minlength=len(x))


def reference(x: torch.Tensor, t: float, top_p=1.0, top_k=0, min_p=0.0) -> torch.Tensor:
    """The distribution the settings define: softmax(x / t), top-k, then top-p and min-p over the renormalised
    probabilities, renormalised (what vLLM and llama.cpp compute)."""
    p = torch.softmax(x.double() / t, -1)
    sp, order = torch.sort(p, descending=True)
    if top_k:
        sp[top_k:] = 0
    sp = sp / sp.sum()
    keep = ((torch.cumsum(sp, -1) - sp) < top_p) & (sp >= min_p * sp[0])
    keep[0] = True
    out = torch.zeros_like(p)
    out[order] = torch.where(keep, sp, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("spec", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                  dict(temperature=1.3, top_k=10), dict(temperature=1.0, min_p=0.05)],
                         ids=["t1", "top-p", "top-k", "min-p"])
def test_the_draws_follow_the_softmax_they_define(spec):
    x = logits(5) / 2
    stat, dof = chi2(draws(x, spec), reference(x, spec["temperature"], spec.get("top_p", 1.0), spec.get("top_k", 0),
                                                spec.get("min_p", 0.0)))
    assert stat < CHI2_999.get(dof, dof + 4 * math.sqrt(2 * dof) + 10), (stat, dof)


def test_the_draws_match_torch_multinomials_on_a_fixed_row():
    """Two samples, one from the engine's sampler and one from torch.multinomial (the CPU sampler before it), on
    one row at temperature 1: a two-sample chi-square (homogeneity) test."""
    x = logits(6) / 2
    ours = draws(x, dict(temperature=1.0))
    theirs = torch.bincount(torch.multinomial(torch.softmax(x, -1), N, replacement=True,
                                              generator=torch.Generator().manual_seed(0)), minlength=V)
    both = ours + theirs
    cells = both >= 10
    a, b = ours[cells].double(), theirs[cells].double()
    stat = float(((a - b) ** 2 / (a + b)).sum())
    dof = int(cells.sum()) - 1
    assert stat < dof + 4 * math.sqrt(2 * dof) + 10, (stat, dof)


def test_a_seeded_row_draws_the_same_token_alone_or_anywhere_in_a_batch():
    x = torch.randn(6, V) * 2
    spec = RowSpec(1.0, 0.9, seed=1234, index=7)
    alone = [choose(x[i:i + 1], [spec])[0] for i in range(6)]
    others = [RowSpec(0.8, seed=s, index=3) for s in range(6)]
    for pos in range(6):
        rows = others[:pos] + [spec] + others[pos + 1:]
        assert choose(x, rows)[pos] == alone[pos]
    assert len({choose(x[:1], [RowSpec(1.0, seed=s, index=0)])[0] for s in range(30)}) > 3   # seeds differ


def test_penalties_push_repeated_tokens_down():
    x = torch.zeros(V)
    x[3], x[4] = 2.0, 1.9
    pen = Penalties(2, V, "cpu")
    pen.reset(1, [3])                              # the prompt holds token 3
    slot = torch.tensor([1])
    assert choose(x[None], [RowSpec(0.0)]) == [3]
    assert choose(x[None], [RowSpec(0.0, repetition_penalty=1.2)], penalties=pen, slots=slot) == [4]
    pen.reset(1, [7])
    assert choose(x[None], [RowSpec(0.0, presence_penalty=0.5)], penalties=pen, slots=slot) == [3]   # output: none yet
    assert choose(x[None], [RowSpec(0.0, presence_penalty=0.5)], penalties=pen, slots=slot) == [4]   # 3 now generated
    assert int(pen.counts[1, 3]) == 1 and bool(pen.seen[1, 7])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")
def test_on_cuda_the_draws_follow_the_softmax_and_equal_the_cpus_ids():
    x = logits(5) / 2
    stat, dof = chi2(draws(x, dict(temperature=0.9, top_p=0.9), "cuda"), reference(x, 0.9, 0.9))
    assert stat < CHI2_999.get(dof, dof + 4 * math.sqrt(2 * dof) + 10)
    rows = [RowSpec(1.0, seed=s, index=s % 5) for s in range(64)]
    xs = (torch.randn(64, 1000) * 3).cuda()
    assert torch.equal(sample(xs, rows)[0], sample(xs, rows)[0])
    one = torch.stack([sample(xs[i:i + 1], rows[i:i + 1])[0][0] for i in range(64)])
    assert torch.equal(one, sample(xs, rows)[0])           # alone or batched, the same ids


@pytest.mark.parametrize("temperature,top_p,seed,message", [
    (float("nan"), 1.0, None, "temperature is nan"),
    (float("inf"), 1.0, None, "temperature is inf"),
    (-0.5, 1.0, None, "temperature is -0.5"),
    (1.0, 0.0, None, "top_p is 0.0"),
    (1.0, float("nan"), None, "top_p is nan"),
    (1.0, 1.5, None, r"top_p is 1.5; it must be in \(0, 1\]"),
    (1.0, 1.0, 2**63, "seed is 9223372036854775808; it must be an integer in -9223372036854775808..9223372036854775807"),
    (1.0, 1.0, -2**63 - 1, "seed is -9223372036854775809"),
    (1.0, 1.0, 10**30, "seed is 10{30}"),
])
def test_bad_parameters_are_named_with_their_limit(temperature, top_p, seed, message):
    with pytest.raises(ValueError, match=message):
        check_params(temperature, top_p, seed)


def test_the_extreme_seeds_of_64_bits_are_taken():
    for s in (-2**63, 2**63 - 1, 0):
        check_params(1.0, 1.0, s)
        assert sample(logits()[None], [RowSpec(1.0, seed=s)])[1].all()


@pytest.mark.parametrize("knob,value,message", [
    ("top_k", -1, "top_k is -1; it must be an integer >= 0"), ("top_k", 1.5, "top_k is 1.5"),
    ("min_p", 1.5, r"min_p is 1.5; it must be in \[0, 1\]"), ("min_p", float("nan"), "min_p is nan"),
    ("repetition_penalty", 0.0, r"repetition_penalty is 0.0; it must be in \(0, 100\]"),
    ("presence_penalty", 2.5, r"presence_penalty is 2.5; it must be in \[-2, 2\]"),
    ("frequency_penalty", float("inf"), "frequency_penalty is inf"),
])
def test_bad_sampler_knobs_are_named_with_their_limit(knob, value, message):
    with pytest.raises(ValueError, match=message):
        check_params(1.0, 1.0, None, **{knob: value})


@pytest.mark.parametrize("spec", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=0.8, top_k=40),
                                  dict(temperature=1.0, min_p=0.05), dict(temperature=0.6, top_p=0.95, top_k=20),
                                  dict(temperature=1.2, top_p=0.999), dict(temperature=1.0, top_k=100000)],
                         ids=["t1", "top-p", "top-k", "min-p", "all", "wide-top-p", "top-k-past-vocab"])
def test_the_cpus_row_draw_is_the_sorted_torch_forms(spec):
    """The CPU draws a row at a time without sorting the vocabulary (engine.sampling._cpu_pick); the same ids as the
    sorted torch form (_pick, what a GPU runs) on rows of distinct logits, a wide top-p included (its kept set
    outgrows the first candidates, which then widen)."""
    from engine.sampling import _clean, _cpu_pick, _pick, pack
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 4096, generator=gen) * 2.5
    rows = [RowSpec(seed=s, index=s % 7, **spec) for s in range(64)]
    floats, ints = pack(rows)
    z, _ = _clean(x)
    best = z.argmax(-1)
    truncate = any(r.truncates for r in rows)
    assert torch.equal(_cpu_pick(z.numpy(), best.numpy(), floats, ints), _pick(z, best, floats, ints, truncate))


def test_the_cpus_number_is_the_tensor_hashs_bit_for_bit():
    from engine.sampling import uniform, uniform_one
    rng = random.Random(4)
    seeds = [0, 1, -1, 2**63 - 1, -2**63] + [rng.randrange(-2**63, 2**63) for _ in range(200)]
    indices = [0, 1, 7, 2**31, 10**12] + [rng.randrange(0, 2**40) for _ in range(200)]
    want = uniform(torch.tensor(seeds), torch.tensor(indices))
    assert [uniform_one(s, i) for s, i in zip(seeds, indices)] == want.tolist()

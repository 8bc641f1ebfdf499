"""engine.sampling at the extremes the API lets through: every value below was a NaN/crash before."""
from __future__ import annotations

import pytest
import torch

from engine.sampling import SamplingError, check_params, choose, make_generator, sample_row

V = 50


def logits(seed=0):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("t", [1e-40, 1e-39, 1e-30, 1e-8, 5e-324])
def test_temperature_towards_zero_is_greedy(t):
    x = logits()
    for s in range(5):
        assert sample_row(x, t, 1.0, make_generator(s, "cpu")) == int(x.argmax())
    assert choose(x[None], [t], [1.0], [make_generator(1, "cpu")]) == [int(x.argmax())]


def test_small_temperatures_that_still_sample_never_divide_to_nan():
    x = logits()
    for t in (1e-4, 1e-3, 0.01):         # (x - max) / t: the best token weighs exactly 1, the rest underflow
        assert sample_row(x, t, 1.0, make_generator(0, "cpu")) == int(x.argmax())


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45, 1e-9])
def test_tiny_top_p_keeps_the_most_likely_token(top_p):
    x = logits(3)
    assert sample_row(x, 1.5, top_p, make_generator(0, "cpu")) == int(x.argmax())


def test_nan_logits_never_win_and_inf_logits_share_the_draw():
    x = logits(1)
    x[7] = float("nan")
    best = int(torch.nan_to_num(x, nan=-1e9).argmax())
    assert choose(x[None], [0.0], [1.0], [None]) == [best]             # argmax alone would pick the NaN
    assert sample_row(x, 1e-6, 1.0, None) == best
    assert sample_row(x, 1.0, 0.5, make_generator(0, "cpu")) != 7
    x[11] = x[13] = float("inf")
    picks = {sample_row(x, 1.0, 1.0, make_generator(s, "cpu")) for s in range(40)}
    assert picks == {11, 13}
    assert choose(x[None], [0.0], [1.0], [None])[0] in (11, 13)


def test_a_row_without_a_finite_logit_fails_alone():
    x = torch.stack([logits(0), torch.full((V,), float("nan")), logits(2), torch.full((V,), float("-inf"))])
    out = choose(x, [0.0, 0.0, 1.0, 0.7], [1.0] * 4, [None, None, make_generator(0, "cpu"), make_generator(1, "cpu")])
    assert out[0] == int(x[0].argmax()) and isinstance(out[2], int)
    assert isinstance(out[1], SamplingError) and isinstance(out[3], SamplingError)
    assert "no finite logit" in str(out[1])


def test_greedy_choice_is_greedy_row_on_every_kind_of_row():
    """choose's one-pass greedy (the row's argmax where its largest logit is finite) against greedy_row, row by row:
    plain, ties (the first wins), some -inf (masked tokens), a NaN, +inf, all -inf."""
    from engine.sampling import greedy_row
    rows = [logits(0), logits(1), logits(2), logits(3), logits(4), torch.full((V,), float("-inf"))]
    rows[1][[4, 9]] = 50.0
    rows[2][::2] = float("-inf")
    rows[3][5] = float("nan")
    rows[4][30] = float("inf")
    x = torch.stack(rows)
    out = choose(x, [0.0] * len(rows), [1.0] * len(rows), [None] * len(rows))
    assert out[1] == 4
    for row, got in zip(rows[:-1], out):
        assert got == greedy_row(row)
    assert isinstance(out[-1], SamplingError)


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
        make_generator(s, "cpu")

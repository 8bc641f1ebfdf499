"""The GPU's fused plain draw (engine.kernels.triton_sampling), run through Triton's interpreter on CPU tensors where
there is no GPU (tests/conftest.py sets TRITON_INTERPRET=1), and as the compiled kernels on a GPU: the same function
as engine.sampling's torch form, which the CPU runs.

Its number u is engine.sampling.uniform's bit for bit; greedy rows take the first argmax; NaN never wins, +inf logits
share the draw, a row with no finite logit is flagged; the draws are the torch form's ids on rows whose tokens are
not within rounding of the boundary, and follow the softmax (chi-square). Small blocks make the logits span several
of the kernel's blocks, so the search across blocks and inside one is exercised."""
from __future__ import annotations

import math
import random

import pytest
import torch

from engine import sampling
from engine.kernels import triton_sampling

pytestmark = pytest.mark.skipif(triton_sampling.triton is None, reason="needs Triton (its interpreter runs here)")

V = 300
DEV = "cuda" if torch.cuda.is_available() else "cpu"      # the interpreter takes CPU tensors, real Triton CUDA ones


def draw(x: torch.Tensor, temperature, seeds, indices, greedy, block=64):
    """plain_draw on DEV, its answers back on the CPU."""
    b = x.shape[0]

    def col(v, dtype):
        return torch.as_tensor(v, dtype=dtype).expand(b).contiguous().to(DEV)
    got = triton_sampling.plain_draw(x.to(DEV), col(temperature, torch.float32), col(seeds, torch.int64),
                                     col(indices, torch.int64), col(greedy, torch.int64), block=block)
    return tuple(t.cpu() for t in got)


def torch_form(x: torch.Tensor, t: float, seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    z, _ = sampling._clean(x)
    return sampling._invert(torch.softmax(z / t, dim=-1), sampling.uniform(seeds, indices))


def test_its_number_is_the_samplers_own_hash():
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -2**63, 1234, -987654321987] * 4)
    indices = torch.arange(len(seeds), dtype=torch.int64) * 977
    x = torch.zeros(len(seeds), 8)
    _, _, u = draw(x, 1.0, seeds, indices, 0)
    assert torch.equal(u, sampling.uniform(seeds, indices))


@pytest.mark.parametrize("block", [64, 2048])
def test_the_draws_are_the_torch_forms_ids(block):
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(64, V, generator=rng) * 3
    seeds = torch.randint(-2**62, 2**62, (64,), generator=rng)
    indices = torch.arange(64, dtype=torch.int64)
    for t in (0.7, 1.0, 1.6):
        ids, ok, _ = draw(x, t, seeds, indices, 0, block=block)
        assert torch.equal(ids, torch_form(x, t, seeds, indices)), t
        assert bool(ok.all())


def test_greedy_rows_take_the_first_argmax_and_bad_rows_are_flagged():
    x = torch.randn(6, V) * 2
    x[0, 7] = x[0, 250] = 50.0                    # a tie across blocks: the first wins
    x[1, :] = float("nan")                         # no finite logit: not ok
    x[2, 100] = float("nan")                       # NaN never wins
    x[2, 5] = 40.0
    x[3, 30] = x[3, 200] = float("inf")            # +inf: the first of them
    x[4, :] = float("-inf")
    x[4, 299] = 0.0                                # one finite logit, in the last partial block
    ids, ok, _ = draw(x, 1.0, 5, 0, 1)
    assert ids[0] == 7 and ids[2] == 5 and ids[3] == 30 and ids[4] == 299
    assert ids[5] == int(x[5].argmax())
    assert ok.tolist() == [1, 0, 1, 1, 1, 1]


def test_infinite_logits_share_the_draw_and_zero_weights_are_never_drawn():
    x = torch.randn(1, V).repeat(60, 1)
    x[:, 3] = x[:, 290] = float("inf")
    x[:, 150] = float("nan")
    ids, ok, _ = draw(x, 1.0, 42, torch.arange(60), 0)
    assert set(ids.tolist()) == {3, 290} and bool(ok.all())
    one = torch.full((40, V), float("-inf"))
    one[:, 131] = -5.0
    assert set(draw(one, 0.8, 7, torch.arange(40), 0)[0].tolist()) == {131}


def test_the_draws_follow_the_softmax():
    """One fixed row of 12 logits over 3 blocks, 800 draws at T = 1.3: a chi-square against softmax(x / T) over the
    cells with >= 10 expected (the interpreter runs a program at a time: the GPU's CUDA test draws more)."""
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(12, generator=gen)
    n = 800
    ids, _, _ = draw(row[None].repeat(n, 1), 1.3, 99, torch.arange(n), 0, block=4)
    p = torch.softmax(row / 1.3, -1).double()
    counts = torch.bincount(ids, minlength=12).double()
    cells = p * n >= 10
    stat = float(((counts[cells] - n * p[cells]) ** 2 / (n * p[cells])).sum()) + \
        float((counts[~cells].sum() - n * p[~cells].sum()) ** 2 / max(n * p[~cells].sum(), 1e-9))
    dof = int(cells.sum())
    assert stat < dof + 4 * math.sqrt(2 * dof) + 10, (stat, dof)


def test_a_row_draws_the_same_token_alone_or_in_any_batch():
    rng = random.Random(1)
    x = torch.randn(5, V) * 2
    seeds, indices = torch.tensor([11, 22, 33, 44, 55]), torch.tensor([3, 1, 4, 1, 5])
    ts = torch.tensor([0.5, 1.0, 1.5, 0.9, 2.0])
    x, seeds, indices, ts = x.to(DEV), seeds.to(DEV), indices.to(DEV), ts.to(DEV)
    together = triton_sampling.plain_draw(x, ts, seeds, indices, torch.zeros(5, dtype=torch.int64, device=DEV),
                                          block=64)[0]
    for i in rng.sample(range(5), 5):
        alone = triton_sampling.plain_draw(x[i:i + 1], ts[i:i + 1], seeds[i:i + 1], indices[i:i + 1],
                                           torch.zeros(1, dtype=torch.int64, device=DEV), block=64)[0]
        assert int(alone[0]) == int(together[i])


def test_bf16_logits_are_read_as_the_engine_hands_them():
    x = (torch.randn(8, V) * 3).bfloat16()
    seeds, indices = torch.arange(8), torch.zeros(8, dtype=torch.int64)
    ids, _, _ = draw(x, 1.0, seeds, indices, 0)
    assert torch.equal(ids, torch_form(x.float(), 1.0, seeds, indices))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")
def test_on_cuda_the_fused_draw_is_the_torch_forms_at_a_real_vocabulary():
    """What the engine runs on a GPU (engine.sampling.draw's PLAIN mode): the default blocks over Qwen's 151,936
    logits; u equals the torch hash on the device, the ids the torch form's, greedy rows the argmax."""
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(16, 151936, generator=gen) * 4).cuda()
    seeds = torch.randint(-2**62, 2**62, (16,), generator=gen).cuda()
    indices = torch.arange(16, dtype=torch.int64).cuda()
    t = torch.full((16,), 1.0, device="cuda")
    greedy = (torch.arange(16) % 4 == 0).long().cuda()
    ids, ok, u = triton_sampling.plain_draw(x, t, seeds, indices, greedy)
    assert torch.equal(u, sampling.uniform(seeds, indices))
    want = torch.where(greedy.bool(), x.argmax(-1), torch_form(x, 1.0, seeds, indices))
    assert torch.equal(ids, want) and bool(ok.all())

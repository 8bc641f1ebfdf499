"""The sampler's plain draw (engine.sampling: temperature, no truncation) as two Triton launches on the GPU, where the
torch form is ~15 launches over the whole vocabulary (clean, argmax, divide, softmax, a float64 cumsum, a search,
the hash of the row's number, the picks): 138 µs a token on the H200 at 151,936 logits (bench/README.md), the gap
between sampled and greedy decode.

  _block_stats  grid (rows, blocks of BLOCK logits): each block's largest logit and its first index (the argmax),
                its count of +inf, and its max and sum of exp(z - max) for z = x / T (the online softmax's parts)
  _draw         one program a row: the blocks' weights, their float64 prefix sums, the block where u × total
                falls, and inside it the first token whose cumulative weight reaches it; greedy rows take the
                argmax; u is engine.sampling.uniform's number, hashed here from the row's (seed, index)

The function is engine.sampling's: NaN never wins, a row with +inf logits draws among those alone, a zero weight
is never drawn, greedy rows take the (first) argmax, and the draw inverts the row's softmax CDF at u. The sums run
in another order than torch's softmax and cumsum, so a token whose cumulative weight lies within rounding of
u × total may differ from the CPU's: the GPU's ids equal themselves in any batch (each row is its own program),
not the CPU's bit for bit. tests/engine/test_sampling_fused.py runs both kernels through Triton's interpreter.
"""
from __future__ import annotations

import torch

from engine.kernels import import_triton

triton, tl = import_triton()

BLOCK = 2048            # logits per program of _block_stats: 75 programs a row at Qwen's 151,936
GREEDY_BELOW = 1e-5     # engine.sampling.GREEDY_BELOW (not imported: engine.sampling imports this module)

if triton is not None:
    @triton.jit
    def _mix(z):
        """splitmix64's finaliser on int64 (engine.sampling._mix: logical shifts as masked arithmetic ones)."""
        z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * -4658895280553007687
        z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685
        return z ^ ((z >> 31) & 0x1FFFFFFFF)

    @triton.jit
    def _block_stats(x_ptr, t_ptr, m_ptr, s_ptr, c_ptr, a_ptr, i_ptr, V, NB, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        b = tl.program_id(1)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(x_ptr + row.to(tl.int64) * V + offs, mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)                      # NaN never wins
        best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        posinf = x == float("inf")
        t = tl.load(t_ptr + row)
        t = tl.where(t < 1e-5, 1.0, t)
        z = tl.where(posinf, float("-inf"), x) / t
        m = tl.max(z, axis=0)
        live = z > float("-inf")           # (-inf) - (-inf) is NaN: a dead logit's exponent is taken as 0 - 0
        s = tl.sum(tl.where(live, tl.exp(tl.where(live, z, 0.0) - tl.where(live, m, 0.0)), 0.0), axis=0)
        k = row * NB + b
        tl.store(m_ptr + k, m)
        tl.store(s_ptr + k, s)
        tl.store(c_ptr + k, tl.sum(posinf.to(tl.int32), axis=0))
        tl.store(a_ptr + k, best)
        tl.store(i_ptr + k, b * BLOCK + at)

    @triton.jit
    def _draw(x_ptr, t_ptr, seed_ptr, index_ptr, greedy_ptr, m_ptr, s_ptr, c_ptr, a_ptr, i_ptr, out_ptr, ok_ptr,
              u_ptr, V, NB, BLOCK: tl.constexpr, NBP: tl.constexpr):
        row = tl.program_id(0)
        blocks = tl.arange(0, NBP)
        bmask = blocks < NB
        k = row * NB + blocks
        m = tl.load(m_ptr + k, mask=bmask, other=float("-inf"))
        s = tl.load(s_ptr + k, mask=bmask, other=0.0)
        c = tl.load(c_ptr + k, mask=bmask, other=0)
        a = tl.load(a_ptr + k, mask=bmask, other=float("-inf"))
        idx = tl.load(i_ptr + k, mask=bmask, other=0)
        # the argmax: the largest block maximum, from the first block that holds it
        top = tl.max(a, axis=0)
        best = tl.min(tl.where(a == top, idx, 2147483647), axis=0)
        npos = tl.sum(c, axis=0)
        big = tl.max(m, axis=0)
        # each block's weight: its +inf count where the row has any, else Σ exp(z - big)
        alive = m > float("-inf")
        w = tl.where(npos > 0, c.to(tl.float64),
                     tl.where(alive, s.to(tl.float64) * tl.exp(tl.where(alive, m, 0.0) - tl.where(alive, big, 0.0)).to(tl.float64), 0.0))
        cum = tl.cumsum(w, axis=0)
        total = tl.sum(w, axis=0)
        # u in (0, 1) from (seed, index): engine.sampling.uniform's hash, in the same int64 arithmetic
        seed = tl.load(seed_ptr + row)
        index = tl.load(index_ptr + row)
        key = _mix(_mix(seed * -7046029254386353131 + index * 7146057691288625177))
        u = (((key >> 11) & 0x1FFFFFFFFFFFFF).to(tl.float64) + 0.5) * (1.0 / 9007199254740992.0)
        target = u * total
        last = tl.max(tl.where(w > 0, blocks, 0), axis=0)           # the last block with weight: rounding's floor
        blk = tl.minimum(tl.sum(((cum < target) & bmask).to(tl.int32), axis=0), last)
        before = tl.sum(tl.where(blocks == blk, cum - w, 0.0), axis=0)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(x_ptr + row.to(tl.int64) * V + offs, mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)
        posinf = x == float("inf")
        t = tl.load(t_ptr + row)
        t = tl.where(t < 1e-5, 1.0, t)
        z = tl.where(posinf, float("-inf"), x) / t
        live = z > float("-inf")
        wt = tl.where(npos > 0, posinf.to(tl.float64),
                      tl.where(live, tl.exp(tl.where(live, z, 0.0) - tl.where(live, big, 0.0)).to(tl.float64), 0.0))
        lanes = tl.arange(0, BLOCK)
        inside = tl.sum(((before + tl.cumsum(wt, axis=0) < target) & mask).to(tl.int32), axis=0)
        drawn = blk * BLOCK + tl.minimum(inside, tl.max(tl.where(wt > 0, lanes, 0), axis=0))
        greedy = tl.load(greedy_ptr + row)
        tl.store(out_ptr + row, tl.where(greedy != 0, best, drawn).to(tl.int64))
        tl.store(ok_ptr + row, ((npos > 0) | (top > float("-inf"))).to(tl.int64))
        tl.store(u_ptr + row, u)


def available(device: torch.device) -> bool:
    """The fused draw runs here: a CUDA device with Triton (engine.sampling uses it there only; the tests call it
    on CPU tensors through Triton's interpreter)."""
    return triton is not None and torch.device(device).type == "cuda"


def plain_draw(x: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, index: torch.Tensor,
               greedy: torch.Tensor, *, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B] int64, whether each row had a finite or +inf logit [B] int64, u [B] float64) for logits x [B, V]
    (any float dtype; NaN, ±inf allowed), temperatures [B] fp32, seeds and draw indices [B] int64, greedy flags
    [B] int64 (1: the row takes its argmax). Two launches, fixed shapes: CUDA-graph capturable. `block`: logits a
    program of the first launch (a power of two; the tests make it small so a row spans several)."""
    b, v = x.shape
    x = x.contiguous()
    nb = triton.cdiv(v, block)
    dev = x.device
    m = torch.empty(b, nb, dtype=torch.float32, device=dev)
    s, a = torch.empty_like(m), torch.empty_like(m)
    c = torch.empty(b, nb, dtype=torch.int32, device=dev)
    i = torch.empty_like(c)
    out = torch.empty(2, b, dtype=torch.int64, device=dev)
    u = torch.empty(b, dtype=torch.float64, device=dev)
    t = temperature.contiguous().float()
    _block_stats[(b, nb)](x, t, m, s, c, a, i, v, nb, BLOCK=block)
    _draw[(b,)](x, t, seed.contiguous(), index.contiguous(), greedy.contiguous(), m, s, c, a, i, out[0], out[1], u,
                v, nb, BLOCK=block, NBP=triton.next_power_of_2(nb))
    return out[0], out[1], u

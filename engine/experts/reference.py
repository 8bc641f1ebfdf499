"""The reference arithmetic every provider and kernel is held to: one SwiGLU expert (expert_ffn) and the plain
per-expert loop over a step's routing (moe_reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(g)·u; with a limit (glm5_next's swiglu_limit, handed to a provider by use_swiglu_limit) g is clamped
    from above and u both ways first, as transformers' Glm5NextTextExperts._apply_gate does. No limit (None, 0 or
    +inf): exactly the two ops every other model computes, so their results keep every bit."""
    if limit and limit != float("inf"):
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return F.silu(g) * u


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               limit: float | None = None) -> torch.Tensor:
    """SwiGLU expert, as transformers computes it: down(silu(gate x) * up x) (gate/up clamped at a limit)."""
    return F.linear(swiglu(F.linear(x, gate), F.linear(x, up), limit), down)


def moe_reference(x, topk_ids, topk_weights, get_views, limit: float | None = None) -> torch.Tensor:
    """The plain per-expert loop every provider must agree with; get_views(e) -> (gate, up, down). Experts
    ascending, each over its (token, k) pairs in row-major order — what (topk_ids == e).nonzero() gives — found
    by one stable sort and ONE read to the host, not a read per expert: on CUDA each read waits for every
    launch before it, so a prefill chunk's 128 experts ran as 128 stalls (tests/engine/test_speed_paths.py
    holds it to the nonzero loop, bit for bit). limit: expert_ffn's swiglu_limit (None: none). The rows and weights are gathered once, in that order, and each
    expert reads its slice: the same values as a gather per expert, two launches fewer per expert."""
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    experts, counts = torch.unique(flat, return_counts=True)
    pairs = torch.argsort(flat, stable=True)               # grouped by expert, row-major within each
    toks, ks = pairs // topk_ids.shape[1], pairs % topk_ids.shape[1]
    xs, ws = x[toks], topk_weights[toks, ks, None]
    start = 0
    for e, n in zip(*torch.stack([experts.long(), counts]).tolist()):
        rows = slice(start, start + n)
        start += n
        gate, up, down = get_views(e)
        xr = xs[rows]
        if xr.data_ptr() % 64:
            # A slice starting mid-row: on some CPUs (AMD EPYC here) the BLAS sums a GEMV whose vector is not
            # 64-byte aligned in another order, so it would not give a gather's bits (what every provider computes).
            xr = xr.clone()
        y = expert_ffn(xr, gate.to(x.dtype), up.to(x.dtype), down.to(x.dtype), limit)
        out.index_add_(0, toks[rows], y * ws[rows].to(y.dtype))
    return out



"""The CPU waves every host-memory provider shares (engine.tiers: memory, tiered, the CPU lane): a step's routing
grouped by expert (group_routes) and moe_reference's arithmetic over experts that come a wave at a time
(moe_forward), on the CPU's pair/single GEMV kernels where they apply and a quantized record's own kernel."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.experts.reference import expert_ffn
from engine.kernels.cpu import pair_ffn, single_ffn
from engine.kernels.quant_cpu import quant_ffn
from engine.quant.expert import QuantExpert


@dataclass(frozen=True)
class Route:
    """The tokens routed to one expert: x rows `tokens`, each through its top-k position `ks`."""

    expert: int
    tokens: list[int]               # ascending
    ks: list[int]


def group_routes(topk_ids: torch.Tensor) -> list[Route]:
    """topk_ids [T,K] grouped by expert, experts ascending and tokens ascending within each: the order
    moe_reference visits them in (torch.unique, then nonzero), from ONE read of topk_ids to the host
    instead of one per expert."""
    by_expert: dict[int, tuple[list[int], list[int]]] = {}
    for t, row in enumerate(topk_ids.tolist()):
        for k, e in enumerate(row):
            toks, ks = by_expert.setdefault(e, ([], []))
            toks.append(t)
            ks.append(k)
    return [Route(e, *by_expert[e]) for e in sorted(by_expert)]


def moe_forward(x: torch.Tensor, topk_weights: torch.Tensor, routes: list[Route],
                resolve: Callable[[list[int]], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
                wave: int, limit: float | None = None) -> torch.Tensor:
    """moe_reference's arithmetic, operation for operation: each expert's FFN on its tokens, accumulated
    into zeros in ascending expert order. The experts come `wave` at a time from resolve(experts) -> their
    (gate, up, down) views (a tiered provider may reuse a wave's slots for the next one). On the CPU with
    two or more threads, neighbours in a wave that each serve one token (a decode step) are computed as
    a pair (pair_ffn), a one-token expert without a neighbour in halves (single_ffn); more tokens per
    expert are GEMMs torch's BLAS already spreads over its threads. Bitwise equal to moe_reference on
    one thread, whatever the wave (tests/engine/test_speed_paths.py). limit: every expert's swiglu limit
    (ExpertProvider.use_swiglu_limit; None: none), carried into each kernel."""
    one_token = x.shape[0] == 1
    out = None if one_token else torch.zeros_like(x)
    paired = x.device.type == "cpu" and torch.get_num_threads() >= 2

    def accumulate(r: Route, y: torch.Tensor):
        nonlocal out
        if one_token:
            # One row: zeros + y*w + y'*w' ... in expert order, without the zeros (0 + a is a) or an index_add.
            w = topk_weights[:, r.ks[0]:r.ks[0] + 1]
            yw = y * (w if w.dtype == y.dtype else w.to(y.dtype))
            out = yw if out is None else out + yw
        else:
            tokens = torch.tensor(r.tokens, device=x.device)
            out.index_add_(0, tokens, y * topk_weights[tokens, torch.tensor(r.ks, device=x.device), None].to(y.dtype))

    for i in range(0, len(routes), wave):
        chunk = routes[i:i + wave]
        views = resolve([r.expert for r in chunk])
        j = 0
        while j < len(chunk):
            r = chunk[j]
            if isinstance(views[j], QuantExpert):         # a quantized record computes with its own kernel
                accumulate(r, quant_ffn(views[j].layout, views[j].record, x if one_token else x[r.tokens], limit))
                j += 1
                continue
            if paired and j + 1 < len(chunk) and len(r.tokens) == len(chunk[j + 1].tokens) == 1:
                ys = pair_ffn(x[r.tokens], x[chunk[j + 1].tokens], views[j], views[j + 1], limit)
                if ys is not None:
                    accumulate(r, ys[0])
                    accumulate(chunk[j + 1], ys[1])
                    j += 2
                    continue
            y = single_ffn(x[r.tokens], views[j], limit) if paired and len(r.tokens) == 1 else None
            if y is None:
                gate, up, down = views[j]
                y = expert_ffn(x[r.tokens], gate.to(x.dtype), up.to(x.dtype), down.to(x.dtype), limit)
            accumulate(r, y)
            j += 1
    return out if out is not None else torch.zeros_like(x)

"""The contract between the models and the expert tiers.

A routed expert is stored, cached and computed as ONE flat record in the checkpoint dtype,
padded to 4 KiB so a record read with O_DIRECT lands directly in a cache slot (the store's
record layout equals a compute slot). Its matrices come in one of two orders, chosen for the
device that computes from the slot:
  rows  gate [I,H] | up [I,H] | down [H,I], as the checkpoint holds them: the GPU kernels' order;
  cols  the same matrices transposed, gate and up side by side: gate_up^T [H,2I] | down^T [I,H].
        A one-token GEMV over a [in, out] matrix streams at about twice the bandwidth of one over
        [out, in] in the CPU's BLAS (bench/results/gemv_orientation.json), and gate|up is one matrix.
views() gives the same logical (gate, up, down) in both orders, so the arithmetic never changes.

Models route (choose experts and weights) and hand the rest to an ExpertProvider:
  out = provider.forward(layer, x, topk_ids, topk_weights)
Providers differ only in *where* the expert weights live (all in memory, or tiered:
GPU slots ← pinned RAM tier ← O_DIRECT store). They must never change a result.

Here: the record layout, the provider protocol, the reference arithmetic (moe_reference) and the routing
arithmetic every provider shares (group_routes, moe_forward). The kernels that compute it fast are in
engine.kernels; the providers in engine.tiers (and engine.gpu); the dense Projection in engine.dense_weights.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from engine.kernels.cpu import pair_ffn, single_ffn

ALIGN = 4096

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


ORDERS = ("rows", "cols")


def order_for(device) -> str:
    """The record order a device computes fastest from: cols on the CPU, rows for the GPU kernels."""
    return "cols" if torch.device(device).type == "cpu" else "rows"


@dataclass(frozen=True)
class ExpertLayout:
    """Byte layout of one expert record (see the module docstring for the two orders), padded to ALIGN.
    quant != "none": a quantized record (engine.quant.records, which owns those layouts); its dtype is
    uint8 (the bytes a slot holds) and views() gives an engine.quant.expert.QuantExpert, which unpacks to
    the same logical (gate, up, down), dequantized, and computes with the device's quantized kernel."""

    hidden: int
    intermediate: int
    dtype: torch.dtype
    order: str = "rows"
    quant: str = "none"

    def __post_init__(self):
        assert self.hidden > 0 and self.intermediate > 0, "expert shape must be positive"
        assert self.order in ORDERS, f"record order {self.order!r} is not one of {ORDERS}"
        if self.quant == "none":
            assert self.dtype in _DTYPE_BYTES, f"unsupported expert dtype {self.dtype}"
        else:
            assert self.dtype == torch.uint8, f"quantized records are bytes (uint8), not {self.dtype}"
            from engine.quant.records import QuantLayout
            object.__setattr__(self, "_q", QuantLayout(self.hidden, self.intermediate, self.quant, self.order))

    @property
    def quantized(self):
        """The engine.quant.records.QuantLayout of a quantized record, else None."""
        return getattr(self, "_q", None)

    @property
    def itemsize(self) -> int:
        return 1 if self.quantized else _DTYPE_BYTES[self.dtype]

    @property
    def matrix_elems(self) -> int:
        return self.hidden * self.intermediate

    @property
    def payload_bytes(self) -> int:
        if self.quantized:
            return self.quantized.payload_bytes
        return 3 * self.matrix_elems * self.itemsize

    @functools.cached_property          # read per decode layer by the tiered provider; the layout is frozen
    def record_bytes(self) -> int:
        return -(-self.payload_bytes // ALIGN) * ALIGN

    @property
    def record_elems(self) -> int:
        return self.record_bytes // self.itemsize

    def views(self, slot: torch.Tensor):
        """(gate [I,H], up [I,H], down [H,I]) as views into a flat slot tensor of record_elems in self.dtype
        (in the cols order they are transposed views: the same values, other strides). A quantized
        record: a QuantExpert over the slot (it unpacks to the dequantized three)."""
        if self.quantized:
            from engine.quant.expert import QuantExpert
            return QuantExpert(self.quantized, slot)
        n, h, i = self.matrix_elems, self.hidden, self.intermediate
        if self.order == "cols":
            gate_up_t = slot[0:2 * n].view(h, 2 * i)
            return gate_up_t[:, :i].t(), gate_up_t[:, i:].t(), slot[2 * n:3 * n].view(i, h).t()
        gate = slot[0:n].view(i, h)
        up = slot[n:2 * n].view(i, h)
        down = slot[2 * n:3 * n].view(h, i)
        return gate, up, down

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """One record (flat, record_elems long, zero padding) from the three matrices (quantized at
        pack time for int8/int4; GGUF blocks go through QuantLayout.pack_blocks)."""
        assert gate.shape == (self.intermediate, self.hidden), f"gate shape {tuple(gate.shape)}"
        assert up.shape == (self.intermediate, self.hidden), f"up shape {tuple(up.shape)}"
        assert down.shape == (self.hidden, self.intermediate), f"down shape {tuple(down.shape)}"
        if self.quantized:
            return self.quantized.pack(gate, up, down)
        rec = torch.zeros(self.record_elems, dtype=self.dtype)
        for view, m in zip(self.views(rec), (gate, up, down)):
            view.copy_(m)
        return rec


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert, as transformers computes it: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class ExpertProvider(Protocol):
    """Where routed experts live. Shapes: x [T,H], topk_ids [T,K] (int64), topk_weights [T,K] (x.dtype)."""

    layout: ExpertLayout

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """Σ_k topk_weights[t,k] · expert_{topk_ids[t,k]}(x[t]) for every token t → [T,H], x.dtype."""
        ...

    def counters(self) -> dict:
        """Tier counters, e.g. {"served": {"gpu": n, "ram": n, "store": n}, "store_read_bytes": n}."""
        ...


def moe_reference(x, topk_ids, topk_weights, get_views) -> torch.Tensor:
    """The plain per-expert loop every provider must agree with; get_views(e) -> (gate, up, down). Experts
    ascending, each over its (token, k) pairs in row-major order — what (topk_ids == e).nonzero() gives — found
    by one stable sort and ONE read to the host, not a read per expert: on CUDA each read waits for every
    launch before it, so a prefill chunk's 128 experts ran as 128 stalls (tests/engine/test_speed_paths.py
    holds it to the nonzero loop, bit for bit). The rows and weights are gathered once, in that order, and each
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
        y = expert_ffn(xs[rows], gate.to(x.dtype), up.to(x.dtype), down.to(x.dtype))
        out.index_add_(0, toks[rows], y * ws[rows].to(y.dtype))
    return out


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
                wave: int) -> torch.Tensor:
    """moe_reference's arithmetic, operation for operation: each expert's FFN on its tokens, accumulated
    into zeros in ascending expert order. The experts come `wave` at a time from resolve(experts) -> their
    (gate, up, down) views (a tiered provider may reuse a wave's slots for the next one). On the CPU with
    two or more threads, neighbours in a wave that each serve one token (a decode step) are computed as
    a pair (pair_ffn), a one-token expert without a neighbour in halves (single_ffn); more tokens per
    expert are GEMMs torch's BLAS already spreads over its threads. Bitwise equal to moe_reference on
    one thread, whatever the wave (tests/engine/test_speed_paths.py)."""
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
            ffn = getattr(views[j], "ffn", None)        # a quantized record computes with its own kernel
            if ffn is not None:
                accumulate(r, ffn(x if one_token else x[r.tokens]))
                j += 1
                continue
            if paired and j + 1 < len(chunk) and len(r.tokens) == len(chunk[j + 1].tokens) == 1:
                ys = pair_ffn(x[r.tokens], x[chunk[j + 1].tokens], views[j], views[j + 1])
                if ys is not None:
                    accumulate(r, ys[0])
                    accumulate(chunk[j + 1], ys[1])
                    j += 2
                    continue
            y = single_ffn(x[r.tokens], views[j]) if paired and len(r.tokens) == 1 else None
            if y is None:
                gate, up, down = views[j]
                y = expert_ffn(x[r.tokens], gate.to(x.dtype), up.to(x.dtype), down.to(x.dtype))
            accumulate(r, y)
            j += 1
    return out if out is not None else torch.zeros_like(x)

"""The contract between the models and the expert tiers.

A routed expert is stored, cached and computed as ONE flat record: gate | up | down,
each row-major in the checkpoint dtype, the record padded to 4 KiB so a record read with
O_DIRECT lands directly in a cache slot (the store's record layout equals a compute slot).

Models route (choose experts and weights) and hand the rest to an ExpertProvider:
  out = provider.forward(layer, x, topk_ids, topk_weights)
Providers differ only in *where* the expert weights live (all in memory, or tiered:
GPU slots ← pinned RAM tier ← O_DIRECT store). They must never change a result.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

ALIGN = 4096

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExpertLayout:
    """Byte layout of one expert record: gate [I,H] | up [I,H] | down [H,I], padded to ALIGN."""

    hidden: int
    intermediate: int
    dtype: torch.dtype

    def __post_init__(self):
        assert self.hidden > 0 and self.intermediate > 0, "expert shape must be positive"
        assert self.dtype in _DTYPE_BYTES, f"unsupported expert dtype {self.dtype}"

    @property
    def itemsize(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def matrix_elems(self) -> int:
        return self.hidden * self.intermediate

    @property
    def payload_bytes(self) -> int:
        return 3 * self.matrix_elems * self.itemsize

    @property
    def record_bytes(self) -> int:
        return -(-self.payload_bytes // ALIGN) * ALIGN

    @property
    def record_elems(self) -> int:
        return self.record_bytes // self.itemsize

    def views(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I,H], up [I,H], down [H,I]) as views into a flat slot tensor of record_elems in self.dtype."""
        n = self.matrix_elems
        gate = slot[0:n].view(self.intermediate, self.hidden)
        up = slot[n:2 * n].view(self.intermediate, self.hidden)
        down = slot[2 * n:3 * n].view(self.hidden, self.intermediate)
        return gate, up, down

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """One record (flat, record_elems long, zero padding) from the three matrices."""
        assert gate.shape == (self.intermediate, self.hidden), f"gate shape {tuple(gate.shape)}"
        assert up.shape == (self.intermediate, self.hidden), f"up shape {tuple(up.shape)}"
        assert down.shape == (self.hidden, self.intermediate), f"down shape {tuple(down.shape)}"
        rec = torch.zeros(self.record_elems, dtype=self.dtype)
        n = self.matrix_elems
        rec[0:n] = gate.reshape(-1).to(self.dtype)
        rec[n:2 * n] = up.reshape(-1).to(self.dtype)
        rec[2 * n:3 * n] = down.reshape(-1).to(self.dtype)
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
    """The plain per-expert loop every provider must agree with; get_views(e) -> (gate, up, down)."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        tok, k = (topk_ids == e).nonzero(as_tuple=True)
        gate, up, down = get_views(e)
        y = expert_ffn(x[tok], gate.to(x.dtype), up.to(x.dtype), down.to(x.dtype))
        out.index_add_(0, tok, y * topk_weights[tok, k, None].to(y.dtype))
    return out


# ---------------------------------------------------------------- the fast path: same arithmetic, fewer syncs, more cores

SPLIT_MIN_BYTES = 1 << 20


class ComputeThreads:
    """Runs the independent pieces of a step (one expert each, or a block of a weight's rows) on `n` CPU
    threads: the caller's and n-1 workers.

    Why: with torch's CPU BLAS a one-token fp32 GEMV is bound by one core's arithmetic (about 12 GB/s of
    weights on the 2-core EPYC this was measured on, against 22 GB/s a core can stream), and torch
    does not split a GEMV over threads itself. Each piece computes exactly what it would alone, and
    the caller combines them in the order it always does, so results are bitwise unchanged.
    set_compute_threads() also sets torch's own intra-op threads to 1 (they would oversubscribe the cores).
    """

    def __init__(self, n: int = 1):
        assert n >= 1, "at least one compute thread"
        self.n = n
        self._pool = ThreadPoolExecutor(n - 1, thread_name_prefix="engine-compute") if n > 1 else None

    def map(self, fn: Callable, items: Sequence) -> list:
        """[fn(i) for i in items], items split into n contiguous runs, run 0 on the calling thread."""
        if self._pool is None or len(items) < 2:
            return [fn(i) for i in items]
        parts = min(self.n, len(items))
        bounds = [len(items) * p // parts for p in range(parts + 1)]
        futures = [self._pool.submit(lambda a, b: [fn(i) for i in items[a:b]], bounds[p], bounds[p + 1])
                   for p in range(1, parts)]
        try:
            out = [fn(i) for i in items[:bounds[1]]]
        finally:
            # Never return while a worker still reads its inputs (a RAM slot may be refilled next).
            rest = [f.result() for f in futures]
        for r in rest:
            out += r
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias) with weight's rows split over the threads: every output element is the
        same dot product as in one call (tests/engine/test_speed_paths.py checks bitwise equality). Only
        weights of SPLIT_MIN_BYTES or more are split; below that the hand-off costs more than it saves."""
        rows = weight.shape[0]
        if (self._pool is None or x.device.type != "cpu" or rows < 128 * self.n
                or weight.numel() * weight.element_size() < SPLIT_MIN_BYTES):
            return F.linear(x, weight, bias)
        step = -(-rows // (self.n * 64)) * 64            # 64-row blocks, so each part starts on a block
        parts = [(weight[a:a + step], None if bias is None else bias[a:a + step]) for a in range(0, rows, step)]
        return torch.cat(self.map(lambda p: F.linear(x, *p), parts), dim=-1)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


_threads = ComputeThreads(1)


def default_threads() -> int:
    """Two compute threads where the process may use two CPUs: a token's top-k experts and lm_head's row
    blocks are the work split, and bench/smollm2_demo_speed.py measured 2 > 1 on 2 cores. More can be
    given explicitly (`engine serve --threads`); they were not measured here."""
    return min(2, len(os.sched_getaffinity(0)))


def set_compute_threads(n: int | None = None) -> ComputeThreads:
    """Use n compute threads for the engine's CPU decode (None: default_threads()); returns the pool."""
    global _threads
    n = default_threads() if n is None else n
    if n < 1:
        raise ValueError(f"threads is {n}; it must be at least 1")
    if n != _threads.n:
        old, _threads = _threads, ComputeThreads(n)
        old.close()
    torch.set_num_threads(1)        # the engine splits the work itself; torch's own threads would oversubscribe
    return _threads


def compute_threads() -> ComputeThreads:
    return _threads


@dataclass(frozen=True)
class Route:
    """The tokens routed to one expert: x rows `tokens`, each through its top-k position `ks`."""

    expert: int
    tokens: torch.Tensor            # int64 [n], ascending
    ks: torch.Tensor                # int64 [n]


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
    dev = topk_ids.device
    return [Route(e, torch.tensor(by_expert[e][0], device=dev), torch.tensor(by_expert[e][1], device=dev))
            for e in sorted(by_expert)]


def moe_forward(x: torch.Tensor, topk_weights: torch.Tensor, routes: list[Route],
                resolve: Callable[[list[int]], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], wave: int,
                threads: ComputeThreads | None = None) -> torch.Tensor:
    """moe_reference's arithmetic, operation for operation: each expert's FFN on its tokens, accumulated
    into zeros in ascending expert order. The experts come `wave` at a time from resolve(experts) -> their
    (gate, up, down) views (a tiered provider may reuse a wave's slots for the next one), and the FFNs of a wave run
    on the compute threads. Bitwise equal to moe_reference (tests/engine/test_speed_paths.py)."""
    threads = threads if threads is not None and x.device.type == "cpu" else _SERIAL
    out = torch.zeros_like(x)
    for i in range(0, len(routes), wave):
        chunk = routes[i:i + wave]
        records = resolve([r.expert for r in chunk])
        ys = threads.map(lambda job: _route_ffn(x, *job), list(zip(chunk, records)))
        for r, y in zip(chunk, ys):
            out.index_add_(0, r.tokens, y * topk_weights[r.tokens, r.ks, None].to(y.dtype))
    return out


def _route_ffn(x: torch.Tensor, route: Route, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
    gate, up, down = views
    return expert_ffn(x[route.tokens], gate.to(x.dtype), up.to(x.dtype), down.to(x.dtype))


_SERIAL = ComputeThreads(1)


class InMemoryExperts:
    """Every expert of every layer held as packed records in one tensor per layer (reference / all-resident)."""

    def __init__(self, layout: ExpertLayout, records: dict[int, torch.Tensor]):
        # records[layer] : [n_experts, record_elems] in layout.dtype
        self.layout = layout
        self.records = records
        self._served = 0

    def forward(self, layer, x, topk_ids, topk_weights):
        recs = self.records[layer]
        self._served += int(topk_ids.numel())
        return moe_forward(x, topk_weights, group_routes(topk_ids),
                           lambda experts: [self.layout.views(recs[e]) for e in experts], len(recs), _threads)

    def counters(self) -> dict:
        return {"served": {"gpu": 0, "ram": self._served, "store": 0}, "store_read_bytes": 0}

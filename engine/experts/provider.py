"""The provider contract: where a model's routed experts live, and every hook the engine calls on them.

Models route (choose experts and weights) and hand the rest to an ExpertProvider:
  out = provider.forward(layer, x, topk_ids, topk_weights)
Providers differ only in *where* the expert weights live (engine.tiers: all in memory, all on the GPU, or tiered
GPU slots ← pinned RAM tier ← O_DIRECT store). They must never change a result.

Every hook the models (engine.models), the CUDA graphs (engine.gpu.graphs), the loader and the scheduler
(engine.llm) use is declared here with its default, which is right for a provider that computes each layer on
the device in one call and has nothing to prefetch, preload or free. A provider overrides what differs; nothing
else in the engine asks a provider what it has (no getattr/hasattr) or sets its attributes: the loader hands the
predictor in (use_predictor) and the graph capture hands its recorder in (capturing).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from engine.experts.layout import ExpertLayout

if TYPE_CHECKING:
    from engine.gpu.graphs import Recorder

# (layer, x) -> (the next MoE layer, its predicted topk_ids) or None: which experts a layer-ahead prefetch copies.
Predictor = Callable[[int, torch.Tensor], "tuple[int, torch.Tensor] | None"]


class ExpertProvider:
    """Where routed experts live. Shapes: x [T,H], topk_ids [T,K] (int64), topk_weights [T,K] (x.dtype)."""

    layout: ExpertLayout
    #: A decode step's forward can be captured in a CUDA graph (whole, or in pieces cut where host steps run).
    graph_capturable: bool = False
    #: A decode step needs the host inside it (reads routing, or computes on the CPU): its launch is not asynchronous.
    host_steps: bool = True
    #: before_decode / after_decode_launch do work between steps, so a step may not launch before the last is read.
    decode_hooks: bool = False
    #: host_records may give the addresses of host-memory records (a native CPU decode step computes from them).
    hands_out_host_records: bool = False
    #: While a graph capture runs (capturing): the Recorder that host steps are handed to instead of running.
    recorder: Recorder | None = None
    #: The routed experts' SwiGLU limit (use_swiglu_limit): gate clamped from above and up both ways before
    #: silu(gate)·up, in every kernel that computes an expert. None: a plain SwiGLU (every model but glm5_next).
    swiglu_limit: float | None = None

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """Σ_k topk_weights[t,k] · expert_{topk_ids[t,k]}(x[t]) for every token t → [T,H], x.dtype."""
        raise NotImplementedError

    def counters(self) -> dict:
        """Tier counters, e.g. {"provider": kind, "served": {"gpu": n, "ram": n, "store": n}, "store_read_bytes": n}."""
        raise NotImplementedError

    def host_records(self, layer: int, experts: list[int]) -> list[int] | None:
        """One token's experts, for the caller to compute on the CPU: their records' host addresses in the given
        order, served and counted as forward would; None where this provider computes them itself (the default)."""
        return None

    def book_host_records(self, first: int, picks: list[list[int]]) -> None:
        """host_records' serving and counting for layers first, first + 1, … whose picks (picks[i]: layer first + i's)
        a native step already computed from host_record_table's resident records (engine.models.common.MoEModel's
        DecodeLayers path); the addresses are not needed. The default books each layer by host_records."""
        for i, experts in enumerate(picks):
            self.host_records(first + i, experts)

    def host_record_table(self, layers: int, top_k: int) -> torch.Tensor | None:
        """The host addresses of the records host_records would hand out without reading anything, int64 [layers,
        experts] (0: not resident), for a native step that routes inside one call (engine.kernels.native.DecodeLayers)
        and gives host_records each layer's picks after; valid until the next host_records. None where host_records
        would say None for top_k picks a layer (the default)."""
        return None

    def graph_pairs_ok(self, pairs: int) -> bool:
        """A captured decode step may hold `pairs` (token, expert) picks a layer (default: any number)."""
        return True

    def before_decode(self) -> None:
        """Called by MoEModel.decode_step before each step's launch (default: nothing)."""

    def after_decode_launch(self, pairs: int) -> None:
        """Called by MoEModel.decode_step once a step of `pairs` picks a layer is launched (default: nothing)."""

    def use_swiglu_limit(self, limit: float | None) -> None:
        """The model's routed-expert SwiGLU limit (glm5_next's swiglu_limit), handed in once when the model is
        built, before any forward; every provider's forward carries it into its kernels (the default keeps it
        here for them). None, 0 or +inf: none."""
        self.swiglu_limit = float(limit) if limit and limit != float("inf") else None

    def use_predictor(self, predictor: Predictor) -> None:
        """The model's layer-ahead routing, handed in by the loader once the model is built; a provider that
        prefetches keeps it, the others ignore it (the default)."""

    @contextmanager
    def capturing(self, recorder: Recorder) -> Iterator[None]:
        """While engine.gpu.graphs captures a decode step: forward hands each host step to recorder.cut(step)
        instead of running it (a provider without host steps never cuts, so the step is one graph)."""
        self.recorder = recorder
        try:
            yield
        finally:
            self.recorder = None

    def preload(self) -> dict | None:
        """Fill the tiers before serving → what was loaded, for the load log; None where nothing is (default)."""
        return None

    def close(self) -> None:
        """Stop threads and close files; the provider serves nothing after (default: nothing to free)."""

"""CUDA-graph decode: what MoEModel.decode_step replays on a CUDA device whose expert provider is
graph-capturable (engine.tiers: ResidentExperts, TieredExperts on CUDA).

One graph chain per (batch size, KV-length bucket), captured on first use and replayed from then on,
so continuous batching (the batch grows and shrinks by a stream at a time) keeps working: each exact
batch size gets its own graphs (padding a batch would route the padding rows to real experts, and
every padded row costs top_k expert reads). Tokens, slots and positions are copied into static device
tensors before each replay (tokens may be the last step's argmax, already on the device: engine.llm's
decode ahead); the step's logits are cloned out of the graph's memory. decode_sampled also draws the step's tokens in a
sampler graph replayed right after (engine.gpu.sampler_graph), so sampling adds one launch, not ~20.

A provider that needs host work inside a step (the tiered provider reads each MoE layer's routing to
copy the experts it lacks) does it between graph pieces: while the Recorder captures (handed to the provider by
ExpertProvider.capturing), the provider calls recorder.cut(host_step), which ends the current piece and begins the next; at replay the host
steps run between the pieces. A resident provider never cuts, so its whole step is one graph.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from engine.gpu.sampler_graph import SamplerGraphs
from engine.kv_cache import kv_bucket
from engine.sampling import Penalties, RowSpec

log = logging.getLogger("engine.gpu")


class Recorder:
    """A decode step captured as a chain of graphs with host steps between them."""

    def __init__(self, pool):
        self.pool = pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.hooks: list[Callable[[], None]] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may make CUDA calls that are not part of this capture.
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def cut(self, hook: Callable[[], None]) -> None:
        """End the current piece; `hook` runs after it at every replay, before the next piece."""
        self._graph.capture_end()
        self.pieces.append(self._graph)
        self.hooks.append(hook)
        self.begin()

    def end(self) -> None:
        self._graph.capture_end()
        self.pieces.append(self._graph)
        self._graph = None

    def abort(self) -> None:
        if self._graph is not None:
            try:
                self._graph.capture_end()
            except RuntimeError:
                pass
            self._graph = None

    def replay(self) -> None:
        for i, g in enumerate(self.pieces):
            g.replay()
            if i < len(self.hooks):
                self.hooks[i]()


class DecodeGraphs:
    def __init__(self, model):
        self.model = model
        dev = model.device
        self.max_batch = model.caches.slots           # SlotCaches: a KV cache, or a model's own (glm5_next)
        self.static = torch.zeros(3, self.max_batch, dtype=torch.long, device=dev)      # ids, positions, slots
        self.host = torch.zeros(3, self.max_batch, dtype=torch.long, pin_memory=True)
        self.copied = torch.cuda.Event()
        self.stream = torch.cuda.Stream(dev)          # captures run on a side stream, as torch requires
        self.pool = torch.cuda.graph_pool_handle()    # one pool: chains replay one at a time
        self.graphs: dict[tuple[int, int], tuple[Recorder, torch.Tensor]] = {}
        self.sampler = SamplerGraphs(dev, self.max_batch)     # the step's sampling, one more graph
        self.captures = 0
        self.replays = 0

    @property
    def pieces_per_step(self) -> int:
        return max((len(r.pieces) for r, _ in self.graphs.values()), default=0)

    def usable(self, batch: int) -> bool:
        return batch <= self.max_batch and self.model.provider.graph_pairs_ok(batch * self.model.cfg.top_k)

    def decode(self, tokens, slots: list[int], positions: list[int]) -> torch.Tensor:
        return self._replay(tokens, slots, positions).clone()

    def decode_sampled(self, tokens, slots: list[int], positions: list[int], rows: list[RowSpec],
                       penalties: Penalties | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """decode(), and the step's tokens for `rows` drawn by the sampler graph replayed right after the step's
        (engine.gpu.sampler_graph): (logits, [2, B] ids and finiteness on the device). A penalised row needs the
        slots' `penalties`."""
        how = self.sampler.stage(rows, slots, penalties is not None)
        if how is None:
            raise ValueError("a penalised row without the slots' Penalties")
        logits = self._replay(tokens, slots, positions)
        drawn = self.sampler.run(logits, how, penalties)
        return logits.clone(), drawn

    def _replay(self, tokens, slots: list[int], positions: list[int]) -> torch.Tensor:
        """The step replayed: its logits, the graph's own tensor (the next replay overwrites it)."""
        b = len(slots)
        kv_len = kv_bucket(max(positions) + 1, self.model.max_len)
        fed = torch.is_tensor(tokens) and tokens.device.type == "cuda"    # the last step's argmax (engine.llm)
        self.copied.synchronize()                     # the staging row is free again
        if not fed:
            self.host[0, :b] = torch.as_tensor(tokens, dtype=torch.long).view(-1)
        self.host[1, :b] = torch.as_tensor(positions, dtype=torch.long)
        self.host[2, :b] = torch.as_tensor(slots, dtype=torch.long)
        self.static.copy_(self.host, non_blocking=True)     # the whole (contiguous) staging: rows past b unused
        self.copied.record()
        if fed:                                       # device to device, in stream order: no host read
            self.static[0, :b].copy_(tokens.view(-1))
        entry = self.graphs.get((b, kv_len))
        if entry is None:
            entry = self.graphs[(b, kv_len)] = self._capture(b, kv_len)
        rec, logits = entry
        rec.replay()
        self.replays += 1
        return logits

    def _forward(self, b: int, kv_len: int) -> torch.Tensor:
        m = self.model
        ids, pos, idx = self.static[0, :b].view(b, 1), self.static[1, :b].view(b, 1), self.static[2, :b]
        return m.head(m._run(ids, m.decode_meta([], idx, idx, pos, kv_len))[:, 0])

    def _capture(self, b: int, kv_len: int) -> tuple[Recorder, torch.Tensor]:
        provider = self.model.provider
        current = torch.cuda.current_stream(self.model.device)
        self.stream.wait_stream(current)
        rec = Recorder(self.pool)
        with torch.cuda.stream(self.stream):
            # Eager first, on this step's own inputs (it writes the same KV entries the replay will):
            # Triton compiles, cuBLAS picks its kernels, a provider makes its slot tables. Bench routing
            # (engine.routing_trace) draws again at the replay: its position goes back, so graphs and eager draw alike.
            bench = self.model.bench_routing
            mark = bench.mark() if bench is not None else None
            self._forward(b, kv_len)
            if bench is not None:
                bench.rewind(mark)
            self.stream.synchronize()
            with provider.capturing(rec):
                try:
                    rec.begin()
                    logits = self._forward(b, kv_len)
                    rec.end()
                except BaseException:
                    rec.abort()
                    raise
        current.wait_stream(self.stream)
        self.captures += 1
        log.info("decode graph captured: batch %d, %d keys, %d piece(s)", b, kv_len, len(rec.pieces))
        return rec, logits

"""The sampler captured as CUDA graphs: engine.sampling.draw over a decode graph's logits, replayed right after
that graph, so a step's sampling costs one graph launch instead of ~20 kernel launches from the host.

Any decode graph class shares it (engine.gpu.graphs.DecodeGraphs; a model's own graphs, e.g. glm5_next's, the
same way): stage(rows) before the step's replay, run(logits, how) after it, on the same stream.

The rows' settings travel as static tensors (engine.sampling.pack's layout: seeds, draw indices, top-k, greedy
flags; temperatures, top-p, min-p), copied from one pinned staging buffer in one copy per step; the uniform
number is hashed from (seed, index) inside the graph, so a seeded row draws what the eager sampler draws, in any
batch. One graph per (logits tensor, batch size, mode): GREEDY (argmax), PLAIN (temperature), TRUNCATE (sorted:
top-k, top-p, min-p), the same ops sample() picks for the same rows, so the ids are sample()'s bit for bit.
Rows mode() cannot express (a repetition, presence or frequency penalty: counts per slot that the host's
Penalties keeps) are the caller's to sample eagerly: stage() answers None.

On a CPU nothing is captured: run() calls draw() eagerly on the staged tensors (what the tests exercise).
"""
from __future__ import annotations

import logging

import torch

from engine.sampling import GREEDY, RowSpec, draw, mode, pack

_INTS, _FLOATS = 4, 6          # pack()'s columns
log = logging.getLogger("engine.gpu")


class SamplerGraphs:
    def __init__(self, device: torch.device, max_batch: int):
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda"
        self.max_batch = max_batch
        n = max_batch
        size = n * _INTS * 8 + n * _FLOATS * 4
        # One staging buffer for both tensors (ints first: 8-byte aligned), one copy to its device twin a step.
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=self.capture)
        self.static = torch.zeros(size, dtype=torch.uint8, device=self.device)
        self.copied = torch.cuda.Event() if self.capture else None
        self.stream = torch.cuda.Stream(self.device) if self.capture else None
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.uncapturable: set[str] = set()
        self.captures = 0
        self.replays = 0

    def _views(self, buf: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(floats [b, 6], ints [b, 4]) inside buf."""
        n = self.max_batch
        ints = buf[:n * _INTS * 8].view(torch.int64).view(n, _INTS)[:b]
        floats = buf[n * _INTS * 8:].view(torch.float32).view(n, _FLOATS)[:b]
        return floats, ints

    def stage(self, rows: list[RowSpec]) -> str | None:
        """Copy these rows' settings into the static tensors (queued on the current stream, before the step that
        samples them) → the mode run() takes, or None where a row needs the eager sampler (a penalty) or the batch
        is larger than the staging."""
        how = mode(rows)
        if how is None or len(rows) > self.max_batch:
            return None
        if how == GREEDY:              # the argmax reads no setting
            return how
        floats, ints = pack(rows)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has left the staging buffer
        hf, hi = self._views(self.host, len(rows))
        hf.copy_(floats)
        hi.copy_(ints)
        self.static.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return how

    def run(self, logits: torch.Tensor, how: str) -> torch.Tensor:
        """[2, B] int64 on the logits' device: the drawn ids, and 1 where a row's id is final (engine.sampling.Picks'
        `drawn`) for logits [B, V] of the rows last staged. The tensor is the graph's own: valid until its next
        replay, which in stream order follows every use the step makes of it (decode ahead copies the ids into the
        next step's inputs, Picks copies them to the host)."""
        floats, ints = self._views(self.static, logits.shape[0])
        if not self.capture or how in self.uncapturable:
            ids, ok = draw(logits, floats, ints, how)
            return torch.stack([ids, ok.long()])
        key = (logits.data_ptr(), tuple(logits.shape), logits.dtype, how)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self.graphs[key] = self._capture(logits, floats, ints, how)
            except RuntimeError as e:        # this torch cannot capture an op of this mode: draw it eagerly from now
                log.warning("sampler graph (%s) not captured, drawn eagerly from now: %s", how, e)
                self.uncapturable.add(how)
                return self.run(logits, how)
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, logits, floats, ints, how) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                draw(logits, floats, ints, how)      # eager once: the sort's and scan's workspaces, kernels chosen
                graph = torch.cuda.CUDAGraph()
                # thread_local: the server's other threads may make CUDA calls that are not part of this capture.
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                    ids, ok = draw(logits, floats, ints, how)
                    out = torch.stack([ids, ok.long()])
        finally:
            current.wait_stream(self.stream)
        self.captures += 1
        return graph, out

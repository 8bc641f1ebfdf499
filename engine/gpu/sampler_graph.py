"""The sampler captured as CUDA graphs: engine.sampling.draw over a decode graph's logits, replayed right after
that graph, so a step's sampling costs one graph launch instead of ~20 kernel launches from the host.

Any decode graph class shares it (engine.gpu.graphs.DecodeGraphs; a model's own graphs, e.g. glm5_next's, the
same way): stage(rows) before the step's replay, run(logits, how) after it, on the same stream.

The rows' settings travel as static tensors (engine.sampling.pack's layout: seeds, draw indices, top-k, greedy
flags; temperatures, top-p, min-p), copied from one pinned staging buffer in one copy per step; the uniform
number is hashed from (seed, index) inside the graph, so a seeded row draws what the eager sampler draws, in any
batch. One graph per (logits tensor, batch size, mode): GREEDY (argmax), PLAIN (temperature), TRUNCATE (sorted:
top-k, top-p, min-p), the same ops sample() picks for the same rows, so the ids are sample()'s bit for bit.
Penalised rows (repetition, presence, frequency) read and record their KV slots' counts (engine.sampling.Penalties,
tensors on the device made once) inside the graph too, from the slots staged beside the settings.

On a CPU nothing is captured: run() calls draw() eagerly on the staged tensors (what the tests exercise).
"""
from __future__ import annotations

import logging

import torch

from engine.sampling import GREEDY, Penalties, RowSpec, draw, mode, pack

_INTS, _FLOATS = 5, 6          # pack()'s columns, and the rows' KV slots beside its ints
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

    def _views(self, buf: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(floats [b, 6], ints [b, 4], slots [b]) inside buf."""
        n = self.max_batch
        ints = buf[:n * _INTS * 8].view(torch.int64).view(n, _INTS)[:b]
        floats = buf[n * _INTS * 8:].view(torch.float32).view(n, _FLOATS)[:b]
        return floats, ints[:, :4], ints[:, 4]

    def stage(self, rows: list[RowSpec], slots: list[int] | None = None, penalised: bool = False) -> str | None:
        """Copy these rows' settings (and their KV slots, whose Penalties counts a penalised batch reads) into the
        static tensors, queued on the current stream before the step that samples them → the mode run() takes, or
        None where the batch is larger than the staging, or a row is penalised and `penalised` is False (the
        caller has no Penalties to hand run())."""
        how = mode(rows, penalised)
        if how is None or len(rows) > self.max_batch:
            return None
        if how == GREEDY:              # the argmax reads no setting
            return how
        floats, ints = pack(rows)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has left the staging buffer
        hf, hi, hs = self._views(self.host, len(rows))
        hf.copy_(floats)
        hi.copy_(ints)
        if slots is not None:
            hs.copy_(torch.as_tensor(slots, dtype=torch.int64))
        self.static.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return how

    def run(self, logits: torch.Tensor, how: str, penalties: Penalties | None = None) -> torch.Tensor:
        """[2, B] int64 on the logits' device: the drawn ids, and 1 where a row's id is final (engine.sampling.Picks'
        `drawn`) for logits [B, V] of the rows last staged. The tensor is the graph's own: valid until its next
        replay, which in stream order follows every use the step makes of it (decode ahead copies the ids into the
        next step's inputs, Picks copies them to the host). `penalties`: the slots' counts, for a batch staged with
        a penalised row (they penalise the logits, and record the ids drawn), inside the graph."""
        floats, ints, slots = self._views(self.static, logits.shape[0])
        if not self.capture or how in self.uncapturable:
            ids, ok = draw(logits, floats, ints, how, penalties, slots)
            return torch.stack([ids, ok.long()])
        key = (logits.data_ptr(), tuple(logits.shape), logits.dtype, how, id(penalties) if penalties is not None else None)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self.graphs[key] = self._capture(logits, floats, ints, slots, how, penalties)
            except RuntimeError as e:        # this torch cannot capture an op of this mode: draw it eagerly from now
                log.warning("sampler graph (%s) not captured, drawn eagerly from now: %s", how, e)
                self.uncapturable.add(how)
                return self.run(logits, how, penalties)
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, logits, floats, ints, slots, how, penalties) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                # eager once (the sort's and scan's workspaces, kernels chosen) on copies of the counts, which the
                # replay that follows the capture records into
                draw(logits, floats, ints, how, penalties.clone() if penalties is not None else None, slots)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the server's other threads may make CUDA calls that are not part of this capture.
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                    ids, ok = draw(logits, floats, ints, how, penalties, slots)
                    out = torch.stack([ids, ok.long()])
        finally:
            current.wait_stream(self.stream)
        self.captures += 1
        return graph, out

"""CUDA-graph decode: one captured graph per (batch, KV-length bucket) replays a whole decode step
— every layer, the lm_head and the greedy pick — with no launches from Python and no host reads.

Needs a graph-safe expert provider (GpuResidentExperts: slots computed on the device). Sequences
sit in KV slots 0..B-1; positions and next tokens live in static device tensors that the graph
itself advances, so a run of N steps is N replays and one synchronisation at the end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.common import MoEModel, Step


class GraphDecoder:
    def __init__(self, model: MoEModel, batch: int, bucket: int = 1024):
        self.model, self.b, self.bucket = model, batch, bucket
        dev = model.device
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.idx = torch.arange(batch, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _step(self, kv_len: int) -> None:
        m, b = self.model, self.b
        s = Step(slots=list(range(b)), sel=slice(0, b), idx=self.idx, positions=self.pos, start=0, kv_len=kv_len,
                 cos=m.cos[self.pos].view(b, 1, 1, -1), sin=m.sin[self.pos].view(b, 1, 1, -1),
                 mask=m._mask(self.pos, kv_len), decode=True)
        logits = F.linear(m._run(self.ids, s)[:, 0], m.lm_head)
        self.ids.copy_(logits.argmax(dim=-1, keepdim=True))
        self.pos.add_(1)

    def _graph(self, kv_len: int) -> torch.cuda.CUDAGraph:
        if kv_len not in self.graphs:
            ids, pos = self.ids.clone(), self.pos.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):           # warm up (Triton compiles, cuBLAS picks) off the graph
                for _ in range(2):
                    self._step(kv_len)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._step(kv_len)
            self.pool = g.pool()
            self.graphs[kv_len] = g
            self.ids.copy_(ids)
            self.pos.copy_(pos)
        return self.graphs[kv_len]

    def start(self, first_tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """first_tokens [B] (the token after each prompt), positions [B] (each prompt's length)."""
        self.ids.copy_(first_tokens.view(-1, 1))
        self.pos.copy_(positions.view(-1, 1))

    def run(self, steps: int, max_pos: int) -> list[torch.Tensor]:
        """`steps` greedy tokens per sequence; max_pos = the largest position at the start (host-known)."""
        out = []
        for i in range(steps):
            need = max_pos + i + 1
            kv_len = min(self.model.max_len, -(-need // self.bucket) * self.bucket)
            self._graph(kv_len).replay()
            out.append(self.ids.clone())
        return out

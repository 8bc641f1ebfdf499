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

from dataclasses import dataclass
from typing import Protocol

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
        return moe_reference(x, topk_ids, topk_weights, lambda e: self.layout.views(recs[e]))

    def counters(self) -> dict:
        return {"served": {"gpu": 0, "ram": self._served, "store": 0}, "store_read_bytes": 0}

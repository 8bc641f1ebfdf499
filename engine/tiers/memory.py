"""InMemoryExperts: every routed expert of every layer held as packed records in memory (the reference
provider, and models small enough to hold whole); engine.tiers.in_memory builds it from a checkpoint."""
from __future__ import annotations

import torch

from engine.experts.layout import ExpertLayout
from engine.experts.provider import ExpertProvider
from engine.tiers.waves import group_routes, moe_forward


class InMemoryExperts(ExpertProvider):
    """Every expert of every layer held as packed records in one tensor per layer (reference / all-resident)."""

    hands_out_host_records = True        # in host memory on the CPU: a native decode step computes from them

    def __init__(self, layout: ExpertLayout, records: dict[int, torch.Tensor]):
        # records[layer] : [n_experts, record_elems] in layout.dtype
        self.layout = layout
        self.records = records
        self._served = 0

    def forward(self, layer, x, topk_ids, topk_weights):
        recs = self.records[layer]
        self._served += int(topk_ids.numel())
        return moe_forward(x, topk_weights, group_routes(topk_ids),
                           lambda experts: [self.layout.views(recs[e]) for e in experts], len(recs),
                           self.swiglu_limit)

    def host_records(self, layer: int, experts: list[int]) -> list[int] | None:
        """ExpertProvider.host_records: None where the records are not in host memory (a CUDA device)."""
        recs = self.records[layer]
        if recs.device.type != "cpu":
            return None
        self._served += len(experts)
        base, stride = recs.data_ptr(), recs.stride(0) * recs.element_size()
        return [base + e * stride for e in experts]

    def host_record_table(self, layers: int, top_k: int) -> torch.Tensor | None:
        """ExpertProvider.host_record_table: every record is resident (None on a CUDA device)."""
        if getattr(self, "_table", None) is None:
            if any(r.device.type != "cpu" for r in self.records.values()):
                return None
            experts = max(len(r) for r in self.records.values())
            self._table = torch.zeros(layers, experts, dtype=torch.int64)
            for layer, recs in self.records.items():
                step = recs.stride(0) * recs.element_size()
                self._table[layer, :len(recs)] = recs.data_ptr() + step * torch.arange(len(recs))
        return self._table

    def counters(self) -> dict:
        return {"provider": "memory", "served": {"gpu": 0, "ram": self._served, "store": 0}, "store_read_bytes": 0}

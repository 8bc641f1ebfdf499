"""ResidentExperts: every routed expert in one device arena, for a GPU that holds them all.

slot = layer base + expert id, computed on the device, so a decode step never reads back to the
host and the whole step is CUDA-graph capturable (engine.gpu.graphs). Decode (few pairs) runs the
slot-indexed GEMV kernels; prefill runs per-expert GEMMs in moe_reference's order.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.experts.layout import ExpertLayout
from engine.experts.provider import ExpertProvider
from engine.kernels.triton_moe import moe_from_slots
from engine.store import manifest as mf
from engine.store.odirect import aligned_buffer, open_direct, pread_full


class ResidentExperts(ExpertProvider):
    graph_capturable = True          # no host read in forward: a decode step is one graph (never cut)
    host_steps = False               # ... and its launch returns before the GPU has computed it

    def __init__(self, layout: ExpertLayout, arena: torch.Tensor, bases: dict[int, int],
                 types: dict[int, tuple] | None = None):
        self.layout, self.arena, self.bases = layout, arena, bases
        self.types = types or {}      # layer -> its records' (gate, up, down) GGML types: the kernels compile them in
        self.picks = 0

    @property
    def nbytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    @classmethod
    def from_store(cls, store_dir: str | Path, device: torch.device) -> "ResidentExperts":
        """Every record of the store into the arena, one layer per O_DIRECT read."""
        m = mf.load(store_dir)
        mf.check_order(m, device, store_dir)
        e, rec = m.experts_per_layer, m.record_bytes
        arena = torch.empty((len(m.moe_layers) * e, m.layout.record_elems), dtype=m.layout.dtype, device=device)
        staging = aligned_buffer(e * rec)
        host = torch.frombuffer(staging, dtype=torch.uint8)[:e * rec]
        fd = open_direct(Path(store_dir) / mf.DATA)
        try:
            for i, layer in enumerate(m.moe_layers):
                pread_full(fd, memoryview(staging)[:e * rec], m.record(layer, 0).offset)   # a layer is contiguous
                arena[i * e:(i + 1) * e].view(torch.uint8).view(-1).copy_(host)
        finally:
            os.close(fd)
        return cls(m.layout, arena, {layer: i * e for i, layer in enumerate(m.moe_layers)},
                   {layer: m.record_types(layer) for layer in m.moe_layers})

    @classmethod
    def from_checkpoint(cls, checkpoint, device: torch.device, dtype: torch.dtype | None = None) -> "ResidentExperts":
        """Every expert of a checkpoint (no store) packed into the arena in the GPU kernels' rows order; a GGUF's
        experts stay the file's own blocks (Checkpoint.record_quant: the ggml records pack-store --quant gguf makes,
        computed by quant_triton's mixed-type kernels), not dequantized at load."""
        from engine.store.source import record_source
        quant = checkpoint.record_quant()
        layout, make = record_source(checkpoint, dtype=dtype if quant == "none" else None, order="rows", quant=quant)
        e = checkpoint.n_experts
        arena = torch.empty((len(checkpoint.moe_layers) * e, layout.record_elems), dtype=layout.dtype, device=device)
        types = {}
        for i, layer in enumerate(checkpoint.moe_layers):
            recs = [make(layer, x) for x in range(e)]
            if layout.quantized:        # a layer's experts are one GGUF tensor a matrix: one type triple a layer
                types[layer] = layout.quantized.record_types(recs[0])
            arena[i * e:(i + 1) * e].copy_(torch.stack(recs))
        return cls(layout, arena, {layer: i * e for i, layer in enumerate(checkpoint.moe_layers)}, types)

    def forward(self, layer, x, topk_ids, topk_weights):
        self.picks += topk_ids.numel()          # a Python int: no device read
        # Decode: the slot GEMV kernels. Prefill: per-expert GEMMs in expert order (moe_reference's arithmetic,
        # the tiered provider's bit for bit). moe_forward's host-side grouping was tried here: 8k prefill fell
        # from 6,575 to 2,729 tok/s on the H200 (bench/results/2026-12-01-h200-served.json), so not that.
        return moe_from_slots(x, self.arena, topk_ids, topk_weights, self.layout, topk_ids, slot_offset=self.bases[layer],
                              limit=self.swiglu_limit, types=self.types.get(layer))

    def counters(self) -> dict:
        return {"provider": "resident", "served": {"gpu": self.picks, "ram": 0, "store": 0}, "store_read_bytes": 0,
                "tiers": {"gpu": {"slots": self.arena.shape[0]}}}

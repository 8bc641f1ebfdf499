"""Mixtral (transformers' MixtralForCausalLM): every layer sparse (block_sparse_moe), softmax over all
experts then the top-k renormalised — the same as a softmax over the top-k logits."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import native
from engine.models.common import MoEModel, WeightSource, native_tail, softmax_topk
from engine.routing_trace import BenchRouting, RoutedBlock


class MixtralBlock(RoutedBlock):
    renormalize = True           # the top-k's weights renormalised (native_step's routing; native.DecodeLayers reads it)

    def __init__(self, model: MoEModel, w: WeightSource, layer: int):
        super().__init__()
        self.layer, self.provider, self.top_k = layer, model.provider, model.cfg.top_k
        self.layers = model.cfg.num_layers             # host_record_table's shape (native_rows)
        self.gate = w.get(f"model.layers.{layer}.block_sparse_moe.gate.weight")
        self.native = model.native_decode and self.gate.dtype == torch.float32 and self.gate.shape[0] <= 1024
        self.tail = native_tail(model, self.provider) if self.native else None

    def use_bench(self, bench: BenchRouting | None) -> None:
        """Bench routing replaces the choice in forward: the one-call native routing (which picks inside the
        kernel) steps aside while it is on."""
        super().use_bench(bench)
        if bench is not None:
            self.native, self.tail = False, None

    def native_step(self, x: torch.Tensor, h: torch.Tensor, next_norm: torch.Tensor, eps: float) -> torch.Tensor | None:
        """A native decode step's MoE half (MoEModel._run_native): route h, compute the picked experts from
        their host records, x += their sum → rms_norm(x)·next_norm; None where the provider computes them."""
        experts = self.tail.route(h, self.gate, self.renormalize)
        addresses = self.provider.host_records(self.layer, experts)
        return None if addresses is None else self.tail(h, addresses, x, next_norm, eps)

    def native_rows(self, x: torch.Tensor, h: torch.Tensor, next_norm: torch.Tensor, eps: float) -> torch.Tensor | None:
        """native_step on T tokens (x, h [T, H]; MoEModel's exact prefill): each row routed, its experts computed and
        summed as native_step computes one token, an expert's tokens in one call; None where the provider computes
        the experts (nothing changed then)."""
        ids, w = native.router_topk_rows(h, self.gate, self.top_k, True)
        experts = torch.unique(ids).tolist()
        table = self.provider.host_record_table(self.layers, self.top_k)
        if table is not None and all(a for a in table[self.layer, experts].tolist()):
            # every pick resident: one native call, then booked in the loop's order (as DecodeLayers books a step)
            out = native.moe_rows(h, ids, w, table[self.layer], x, next_norm, eps, self.tail)
            for e in experts:
                self.provider.host_records(self.layer, [e])
            return out
        t, k = ids.shape
        y = torch.empty(t * k, h.shape[1])
        flat = ids.view(-1)
        for e in torch.unique(flat).tolist():          # ascending; each expert's record fetched, then computed
            picks = (flat == e).nonzero().view(-1)       # t·k + j of each pick of e
            addresses = self.provider.host_records(self.layer, [e])
            if addresses is None:
                return None
            y[picks] = native.int4_ffn_rows(h[picks // k], addresses[0], self.tail)
        return native.moe_sum_rows(y.view(t, k, -1), ids, w, x, next_norm, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.shape[0] == 1 and x.dtype == torch.float32:    # one token: routed in one native call
            ids, weights = native.router_topk(x.reshape(-1).contiguous(), self.gate, self.top_k, True)
        else:
            ids, weights = softmax_topk(F.linear(x, self.gate), self.top_k, True, x.dtype)
        return self.provider.forward(self.layer, x, self.pick(ids), weights)


class Mixtral(MoEModel):
    def build_moe(self, w: WeightSource, layer: int) -> nn.Module:
        return MixtralBlock(self, w, layer)

"""GLM-4.5 MoE (transformers' Glm4MoeForCausalLM): the first `first_k_dense_replace` layers dense;
MoE layers route with sigmoid scores + e_score_correction_bias (selection only), group-limited top-k
(n_group / topk_group), renormalised weights × routed_scaling_factor, plus always-on shared experts.
The router weight and bias stay fp32 whatever the model dtype (transformers keeps them fp32 too).
Attention: partial rotary, optional q/k norm and q/k/v biases (handled in common.Attention)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.common import MLP, MoEModel, WeightSource, sigmoid_grouped_topk
from engine.routing_trace import RoutedBlock


class Glm4MoeBlock(RoutedBlock):
    def __init__(self, model: MoEModel, w: WeightSource, layer: int):
        super().__init__()
        p = f"model.layers.{layer}.mlp"
        self.layer, self.provider, self.cfg = layer, model.provider, model.cfg
        self.gate = w.get(f"{p}.gate.weight", fp32=True)
        self.bias = w.get(f"{p}.gate.e_score_correction_bias", fp32=True)
        self.shared = MLP(w, f"{p}.shared_experts") if model.cfg.n_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        return sigmoid_grouped_topk(F.linear(x.float(), self.gate), self.bias, top_k=c.top_k, n_group=c.n_group,
                                    topk_group=c.topk_group, renormalize=c.norm_topk_prob,
                                    scale=c.routed_scaling_factor, out_dtype=x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.provider.forward(self.layer, x, self.pick(ids), weights)
        return out + self.shared(x) if self.shared is not None else out


class Glm4Moe(MoEModel):
    def build_moe(self, w: WeightSource, layer: int) -> nn.Module:
        return Glm4MoeBlock(self, w, layer)

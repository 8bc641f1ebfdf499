"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM): q/k RMSNorm per head, softmax routing with optional
renormalised top-k (norm_topk_prob), dense MLP on mlp_only_layers / off the decoder_sparse_step."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import triton_decode
from engine.models.common import MoEModel, WeightSource, softmax_topk
from engine.routing_trace import RoutedBlock


class Qwen3MoeBlock(RoutedBlock):
    def __init__(self, model: MoEModel, w: WeightSource, layer: int):
        super().__init__()
        self.layer, self.provider, cfg = layer, model.provider, model.cfg
        self.gate = w.get(f"model.layers.{layer}.mlp.gate.weight")
        self.top_k, self.renormalize = cfg.top_k, cfg.norm_topk_prob
        # softmax, top-k and renormalisation in one launch (any number of tokens: the same function)
        self.route = triton_decode.softmax_topk if (
            model.fused_kernels and triton_decode.topk_ok(cfg.n_experts, cfg.top_k)) else softmax_topk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Router logits in the model dtype, softmax in fp32, weights back in the model dtype (as transformers).
        ids, weights = self.route(F.linear(x, self.gate), self.top_k, self.renormalize, x.dtype)
        return self.provider.forward(self.layer, x, self.pick(ids), weights)


class Qwen3Moe(MoEModel):
    def build_moe(self, w: WeightSource, layer: int) -> nn.Module:
        return Qwen3MoeBlock(self, w, layer)

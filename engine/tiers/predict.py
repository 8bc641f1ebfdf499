"""Layer-ahead expert prediction: the next MoE layer's router applied to this layer's input.

The residual stream changes little from one layer to the next, so the next router scores this
layer's input much as it will score its own: the experts it picks are worth reading ahead (the
seed's layer-ahead routing). Used by the GPU offload path (copies) and the CPU tiered path (store
reads); a wrong guess costs only bandwidth, never a result.
"""
from __future__ import annotations

from typing import Callable

import torch

# (layer, this layer's MoE input) -> (next MoE layer, predicted expert ids [T, k]) or None (the last layer)
Predictor = Callable[[int, torch.Tensor], "tuple[int, torch.Tensor] | None"]


def layer_ahead_predictor(model) -> Predictor:
    """Apply the next MoE layer's router to this layer's input (the seed's layer-ahead routing)."""
    from engine.models.common import softmax_topk
    moe = [l for l in range(len(model.layers)) if hasattr(model.layers[l].mlp, "gate")]
    nxt = {a: b for a, b in zip(moe, moe[1:])}

    def predict(layer: int, x: torch.Tensor):
        if layer not in nxt:
            return None
        block = model.layers[nxt[layer]].mlp
        ids, _ = softmax_topk(torch.nn.functional.linear(x, block.gate), block.top_k, False, x.dtype)
        return nxt[layer], ids
    return predict

"""Which projection a checkpoint's dense weights become: a GGUF file's own blocks in their types
(engine.gguf_tensors), the 4-bit blocks `engine convert --attention-blocks` kept, or float weights
(engine.dense_weights). Apart from both, since gguf_tensors builds on dense_weights' projections."""
from __future__ import annotations

import torch

from engine import gguf_tensors
from engine.checkpoint import CheckpointError
from engine.dense_weights import Int4Projection, Projection, block_shape, int4_fits
from engine.quant.records import dequantize_matrix


def gguf_projection(w, names: list[str], rows: bool = False):
    """The projection of weights `names` (stacked) where the checkpoint is a GGUF whose blocks hold every one of
    them (engine.gguf_model's ggml_blocks): kept in their own types on the CPU (engine.gguf_tensors.projection),
    dequantized once elsewhere. None where any is not (a float tensor, a checkpoint directory)."""
    ggml_blocks = getattr(w, "ggml_blocks", None)      # glm5_next's shape-checked source: floats only
    kept = [ggml_blocks(f"{n}.weight") for n in names] if ggml_blocks is not None else [None]
    if any(k is None for k in kept):
        return None
    return gguf_tensors.projection([(n, *k) for n, k in zip(names, kept)], device=w.device, dtype=w.dtype, rows=rows,
                                   blocks_only=w.int8_activations, device_blocks=getattr(w, "gpu_blocks", True))


def dense_projection(w, names: list[str], bias: torch.Tensor | None):
    """The projection of checkpoint weights `names` (stacked along the output, in order): a GGUF's 4-bit blocks
    where the checkpoint kept them (engine convert --attention-blocks) stay 4-bit on the CPU and are
    dequantized on other devices; a GGUF file's own blocks of any type (no bias) as gguf_projection keeps them;
    float weights are a Projection as before."""
    parts = [w.blocks(n) for n in names]
    if all(p is None for p in parts):
        if bias is None and (kept := gguf_projection(w, names)) is not None:
            return kept
        return Projection(torch.cat([w.get(f"{n}.weight") for n in names]) if len(names) > 1
                          else w.get(f"{names[0]}.weight"), bias)
    if any(p is None for p in parts):
        raise CheckpointError(f"{', '.join(names)}: some kept as GGUF blocks, some as float weights (one projection "
                              "takes one form)")
    if bias is not None:
        raise CheckpointError(f"{', '.join(names)}: a bias beside GGUF blocks (engine convert writes none)")
    if torch.device(w.device).type == "cpu" and int4_fits(parts):
        return Int4Projection(parts)
    dense = [dequantize_matrix(s, b.reshape(-1), *block_shape(s, b)) for s, b in parts]
    return Projection(torch.cat(dense).to(device=w.device, dtype=w.dtype))

"""Where pack-store's records come from: the checkpoint's float experts (as they are, or quantized to
int8/int4 here) or a GGUF file's own expert blocks. Deterministic: the same inputs give the same bytes,
whatever the machine's tiers."""
from __future__ import annotations

import os
import hashlib
from typing import Callable

import torch

from engine.errors import EngineError, Exit
from engine.experts.layout import ExpertLayout
from engine.gguf_model import GgufModel
from engine.gguf_tensors import expert_layout
from engine.quant.gguf import GGUF_SHA256_KEY, GgufExperts
from engine.quant.records import QuantLayout

QUANT_CHOICES = ("none", "int8", "int4", "gguf")
# A GGUF whose experts are not the checkpoint's (another model, another size) dequantizes far from them;
# one made from them lands within its quantization error (Q4: about 0.1 relative; converted: 0).
GGUF_MATCH_REL_ERR = 0.35


def record_source(ck, *, dtype: torch.dtype | None = None, order: str = "rows", quant: str = "none",
                  gguf: str | os.PathLike | None = None) -> tuple[ExpertLayout, Callable[[int, int], torch.Tensor]]:
    """(layout, make) with make(layer, expert) -> that expert's whole record."""
    if quant not in QUANT_CHOICES:
        raise EngineError(f"--quant {quant!r} is not one of {', '.join(QUANT_CHOICES)}", Exit.USAGE)
    own = isinstance(ck, GgufModel)          # a GGUF model: --quant gguf packs its own blocks
    if own and gguf is not None and not os.path.samefile(gguf, ck.dir):
        raise EngineError(f"--gguf {gguf}: a GGUF --model packs its own expert blocks ({ck.dir}); give no other "
                          f"file", Exit.USAGE)
    if quant != "gguf" and gguf is not None or quant == "gguf" and gguf is None and not own:
        raise EngineError("--gguf FILE goes with --quant gguf (the file's own expert blocks), and only with it",
                          Exit.USAGE)
    if quant in ("none", "int8", "int4"):
        if not ck.has_experts:
            raise EngineError(f"{ck.dir}: holds no expert weights (engine convert --no-expert-weights); pack its "
                              f"store from the GGUF's own blocks: --quant gguf --gguf FILE", Exit.USAGE)
        try:
            layout = ck.layout(dtype, order, quant)
        except (AssertionError, ValueError) as e:
            raise EngineError(f"{ck.dir}: experts [{ck.moe_intermediate}x{ck.hidden}] cannot be {quant} records ({e})",
                              Exit.BAD_MODEL) from None
        return layout, lambda l, e: layout.pack(*ck.expert(l, e))

    src = GgufExperts(ck.dir if own else gguf, layers=ck.moe_layers, experts=ck.n_experts, hidden=ck.hidden,
                      intermediate=ck.moe_intermediate, tensors=ck.tensors if own else None)
    try:
        layout = expert_layout(ck.hidden, ck.moe_intermediate, src.layer_types.values(), order=order)
    except (AssertionError, ValueError) as e:
        raise EngineError(f"{src.path}: its experts cannot be {order} records ({e})", Exit.BAD_MODEL) from None
    if own:
        pass                # the blocks are the model's own: nothing to match
    elif ck.has_experts:
        check_gguf_matches(ck, src, layout)
    else:
        check_gguf_is_the_source(ck, src.path)
    if not src.shared_across_experts:
        return layout, lambda l, e: layout.quantized.pack_blocks(*src.blocks(l, e), types=src.layer_types[l])
    last: dict = {}

    def make_shared(l, e):          # the same record for every expert of layer l: pack it once per layer
        if l not in last:
            last.clear()
            last[l] = layout.quantized.pack_blocks(*src.blocks(l, 0), types=src.layer_types[l])
        return last[l].clone()
    return layout, make_shared


def check_gguf_is_the_source(ck, path) -> None:
    """A checkpoint converted without its experts names the GGUF it came from (engine.quant.gguf.GGUF_SHA256_KEY):
    its experts are that file's, so any other file is refused by name."""
    want = ck.config.get(GGUF_SHA256_KEY)
    if want is None:
        return              # engine synth's store-backed checkpoints name no GGUF
    with open(path, "rb") as f:
        got = hashlib.file_digest(f, "sha256").hexdigest()
    if got != want:
        raise EngineError(f"{path}: sha256 {got[:12]}… is not {ck.dir}'s source GGUF ({want[:12]}…); "
                          f"its experts would not be this checkpoint's", Exit.BAD_MODEL)


def check_gguf_matches(ck, src, layout: ExpertLayout) -> None:
    """The GGUF's first and last experts dequantize close to the checkpoint's (exactly, for a checkpoint
    engine.convert made from this file): a GGUF of another model is refused by name."""
    rows = QuantLayout(layout.hidden, layout.intermediate, layout.quant, "rows")
    for l, e in {(ck.moe_layers[0], 0), (ck.moe_layers[-1], ck.n_experts - 1)}:
        got = rows.dequantize(rows.pack_blocks(*src.blocks(l, e), types=src.layer_types[l]))
        for name, g, w in zip(("gate", "up", "down"), got, ck.expert(l, e)):
            w = w.float()
            rel = float((g - w).norm() / w.norm().clamp_min(1e-30))
            if rel > GGUF_MATCH_REL_ERR:
                raise EngineError(f"{src.path}: layer {l} expert {e} {name} differs from {ck.dir}'s by {rel:.2f} "
                                  f"(relative); this GGUF is not that checkpoint's", Exit.BAD_MODEL)

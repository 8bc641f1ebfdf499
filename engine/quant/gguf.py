"""Routed experts' raw blocks from a GGUF file, as users download it (gguf's own reader; no dequantizing).

Two shapes of GGUF hold experts: an MoE GGUF stacks each layer's experts in one tensor
(blk.L.ffn_{gate,up,down}_exps.weight, [E, out, row bytes]); a dense Llama GGUF that engine.convert
sparse-upcycled holds one MLP per layer (blk.L.ffn_{gate,up,down}.weight), which every expert of the
converted checkpoint copies. Either way expert e of layer l is three [out, row bytes] uint8 arrays,
the file's blocks byte for byte.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.errors import EngineError, Exit
from engine.quant import ggml

# GGML types whose one-type record schemes (and the dense Int4Projection) predate per-matrix types: name -> scheme.
GGUF_TYPES = {"Q8_0": "q8_0", "Q4_1": "q4_1", "Q4_K": "q4_k"}
# config.json of a checkpoint engine.convert made without its experts: the sha256 of the GGUF they stay in
GGUF_SHA256_KEY = "kiln_source_gguf_sha256"
_KINDS = ("ffn_gate", "ffn_up", "ffn_down")


def open_reader(path: str | Path):
    """The gguf package's reader over `path` (a memory map); EngineError (exit BAD_MODEL) naming the file when it
    is missing, truncated or no GGUF, MISSING_DEP when the package is."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise EngineError("the `gguf` package is required to read GGUF files: pip install gguf", Exit.MISSING_DEP) from None
    try:
        return GGUFReader(str(path))
    except FileNotFoundError:
        raise EngineError(f"{path}: no such file", Exit.BAD_MODEL) from None
    except ValueError as e:
        if "reshape" in str(e):             # the reader maps a tensor whose bytes end past the file's end
            raise EngineError(f"{path}: truncated: the tensor data runs past the end of the file "
                              f"({Path(path).stat().st_size} bytes)", Exit.BAD_MODEL) from None
        raise EngineError(f"{path}: not a readable GGUF file ({e})", Exit.BAD_MODEL) from None
    except (OSError, IndexError) as e:
        raise EngineError(f"{path}: not a readable GGUF file ({e})", Exit.BAD_MODEL) from None


class GgufExperts:
    """The expert tensors of one GGUF, checked against the checkpoint's expert shape and count. Each of a layer's
    three matrices may have its own GGML type (engine.quant.ggml), and layers may differ (a Q4_K_M's Q6_K downs)."""

    def __init__(self, path: str | Path, *, layers: list[int], experts: int, hidden: int, intermediate: int,
                 tensors: dict | None = None):
        """tensors: the file's tensors by name where the caller has opened it already (a split set's parts
        together: engine.gguf_model.GgufModel.tensors); else the file at `path` is read here."""
        self.path = Path(path)
        by_name = tensors if tensors is not None else self._read(self.path)
        self.experts, self._tensors = experts, {}
        self.layer_types: dict[int, tuple[str, str, str]] = {}     # layer -> (gate, up, down) GGML type names
        shapes = {"ffn_gate": (intermediate, hidden), "ffn_up": (intermediate, hidden), "ffn_down": (hidden, intermediate)}
        for l in layers:
            types = []
            for kind in _KINDS:
                t = by_name.get(f"blk.{l}.{kind}_exps.weight") or by_name.get(f"blk.{l}.{kind}.weight")
                if t is None:
                    raise EngineError(f"{self.path}: no blk.{l}.{kind}_exps.weight or blk.{l}.{kind}.weight "
                                      f"(the checkpoint's MoE layer {l})", Exit.BAD_MODEL)
                try:
                    typ = ggml.ggml_type(int(t.tensor_type))
                except ggml.UnknownType as e:
                    raise EngineError(f"{self.path}: {t.name}: {e}", Exit.BAD_MODEL) from None
                stacked = t.name.endswith("_exps.weight")
                out, inp = shapes[kind]
                ne = [int(n) for n in t.shape]          # ggml order: [in, out(, experts)]
                want = [inp, out, experts] if stacked else [inp, out]
                if ne != want:
                    raise EngineError(f"{self.path}: {t.name} has shape {ne}, the checkpoint's experts need "
                                      f"{want} (ggml order)", Exit.BAD_MODEL)
                types.append(typ.name)
                self._tensors[(l, kind)] = (t.data, stacked)
            self.layer_types[l] = tuple(types)  # type: ignore[assignment]
        # An upcycled dense GGUF: every expert of a layer is the same MLP, so one record serves them all.
        self.shared_across_experts = not any(stacked for _, stacked in self._tensors.values())

    @staticmethod
    def _read(path: Path) -> dict:
        return {t.name: t for t in open_reader(path).tensors}

    def blocks(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) of one expert as the file's blocks: uint8 [out, row bytes] each (copies)."""
        out = []
        for kind in _KINDS:
            data, stacked = self._tensors[(layer, kind)]
            rows = data[expert] if stacked else data
            raw = np.array(rows, copy=True)         # F16/F32 tensors are read as floats: their bytes are the blocks
            out.append(torch.from_numpy(raw.view(np.uint8).reshape(len(rows), -1)))
        return tuple(out)  # type: ignore[return-value]

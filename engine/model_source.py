"""What a --model path is: a Hugging Face checkpoint directory or a GGUF file (or split set), opened as the
Checkpoint the loader, the providers and pack-store read, and its tokenizer."""
from __future__ import annotations

import json
import os
from pathlib import Path

from engine.checkpoint import Checkpoint
from engine.gguf_model import GgufModel, is_gguf, load_tokenizer as gguf_tokenizer


def open_checkpoint(path: str | os.PathLike | Checkpoint) -> Checkpoint:
    """The model at `path` (a Checkpoint passes through): CheckpointError (GgufError for a GGUF) when it is none."""
    if isinstance(path, Checkpoint):
        return path
    return GgufModel(path) if is_gguf(path) else Checkpoint(path)


def load_tokenizer(ckpt: Checkpoint):
    """The model's tokenizer: a checkpoint directory's files, or a GGUF's metadata."""
    if isinstance(ckpt, GgufModel):
        return gguf_tokenizer(ckpt)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    if _generic_fast_tokenizer(ckpt.dir):
        # A plain tokenizer.json needs no model config; AutoTokenizer would parse config.json, and an installed
        # transformers that knows the architecture in another form (glm5_next before 5.25) refuses it.
        return PreTrainedTokenizerFast.from_pretrained(ckpt.dir)
    return AutoTokenizer.from_pretrained(ckpt.dir)


def _generic_fast_tokenizer(folder) -> bool:
    """Whether the folder's tokenizer is the generic fast one (tokenizer.json, no model-specific class)."""
    config = Path(folder) / "tokenizer_config.json"
    if not (Path(folder) / "tokenizer.json").is_file() or not config.is_file():
        return False
    try:
        name = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return name in ("PreTrainedTokenizerFast", "TokenizersBackend")

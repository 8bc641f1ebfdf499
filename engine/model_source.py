"""What a --model path is: a Hugging Face checkpoint directory or a GGUF file (or split set), opened as the
Checkpoint the loader, the providers and pack-store read, and its tokenizer."""
from __future__ import annotations

import os

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
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(ckpt.dir)

"""Read a Hugging Face MoE checkpoint as published: config.json + (sharded) safetensors.

Knows where each architecture keeps its routed experts, so the store, the models and the
tests agree on what "expert e of layer l" is. Tensors are read lazily (safetensors mmap).
"""
from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from engine.experts.layout import ExpertLayout
from engine.glm5_next_config import Glm5Spec, SpecError

# model_type -> (mlp prefix, gate/up/down names, keys of the expert count, key of the expert FFN width).
# Published configs and transformers 5's save_pretrained name the expert count differently.
ARCHS = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), ("num_experts", "num_local_experts"),
                  "moe_intermediate_size"),
    "glm4_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), ("n_routed_experts", "num_local_experts"),
                 "moe_intermediate_size"),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), ("num_local_experts",), "intermediate_size"),
    "glm5_next": ("mlp", ("gate_proj", "up_proj", "down_proj"), ("n_routed_experts", "num_local_experts"),
                  "moe_intermediate_size"),
}
# transformers 5 saves a multimodal model's text weights under model.language_model.* and its text config nested
# (text_config); the published flat form has them at model.* and top level. Read both as the flat form.
_NESTED_TEXT = "model.language_model."
_VISION = ("model.visual.",)           # a vision tower: not part of the text model, left unread


def _flat_config(config: dict) -> dict:
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    rest = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    return {**rest, **{k: v for k, v in text.items() if k != "model_type"}, "model_type": config.get("model_type")}


class CheckpointError(Exception):
    """A checkpoint that cannot be read as a supported MoE model; the message names file and reason."""


class Checkpoint:
    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        cfg_path = self.config_path = self.dir / "config.json"
        try:
            self.config: dict = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{cfg_path}: missing (not a Hugging Face checkpoint directory)") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        self.config = _flat_config(self.config)
        self._stored: dict[str, str] = {}       # the model's name -> the file's, where they differ
        self._take_config(cfg_path)
        self._files = self._index()
        self.has_vision = any(k.startswith(_VISION) for k in self._files)
        if self.has_vision:
            self._files = {k: v for k, v in self._files.items() if not k.startswith(_VISION)}

    def _take_config(self, where) -> None:
        """The expert shape and count from self.config (a config.json's keys; engine.gguf_model writes the same
        keys from a GGUF's metadata), checked."""
        self.arch = self.config.get("model_type", "")
        if self.arch not in ARCHS:
            raise CheckpointError(f"{where}: model_type {self.arch!r} is not supported "
                                  f"(supported: {', '.join(sorted(ARCHS))})")
        self._mlp, self._names, n_keys, i_key = ARCHS[self.arch]
        n_key = next((k for k in n_keys if self.config.get(k)), None)
        if n_key is None or i_key not in self.config:
            raise CheckpointError(f"{where}: {self.arch} config lacks {n_keys[0]} or {i_key}")
        if self.arch == "glm5_next":        # its own schedule and fields, refused by name before anything is read
            try:
                Glm5Spec.from_config(self.config)
            except SpecError as e:
                raise CheckpointError(f"{where}: {e}") from None
        self.n_experts = int(self.config[n_key])
        self.hidden = int(self.config["hidden_size"])
        self.moe_intermediate = int(self.config[i_key])
        self.num_layers = int(self.config["num_hidden_layers"])

    def _index(self) -> dict[str, Path]:
        idx = self.dir / "model.safetensors.index.json"
        if idx.exists():
            weight_map = json.loads(idx.read_text())["weight_map"]
            return {self._name(k): self.dir / v for k, v in weight_map.items()}
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors files")
        out = {}
        for f in files:
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    out[self._name(k)] = f
        return out

    def _name(self, stored: str) -> str:
        if not stored.startswith(_NESTED_TEXT):
            return stored
        name = "model." + stored[len(_NESTED_TEXT):]
        self._stored[name] = stored
        return name

    @cached_property
    def moe_layers(self) -> list[int]:
        """Layers with routed experts (GLM's first_k_dense_replace / Qwen's mlp_only_layers are dense)."""
        if types := self.config.get("mlp_layer_types"):      # glm5_next's schedule: "dense" | "sparse" per layer
            return [l for l, t in enumerate(types) if t == "sparse"]
        first_dense = int(self.config.get("first_k_dense_replace", 0) or 0)
        mlp_only = set(self.config.get("mlp_only_layers", []) or [])
        step = int(self.config.get("decoder_sparse_step", 1) or 1)
        layers = []
        for l in range(self.num_layers):
            if l < first_dense or l in mlp_only or (step > 1 and (l + 1) % step != 0):
                continue
            layers.append(l)
        return layers

    @cached_property
    def dtype(self) -> torch.dtype:
        """The experts' dtype; a checkpoint whose experts live only in a store (engine synth) has
        none, so its config's dtype (or the first tensor's) stands in."""
        name = self.expert_key(self.moe_layers[0], 0, 0)
        if name in self._files:
            return self.tensor(name).dtype
        declared = self.config.get("dtype") or self.config.get("torch_dtype")
        if isinstance(declared, str) and isinstance(getattr(torch, declared, None), torch.dtype):
            return getattr(torch, declared)
        return self.tensor(next(iter(self._files))).dtype

    @property
    def has_experts(self) -> bool:
        """False for a store-backed checkpoint (its routed experts were synthesized straight into a store)."""
        return self.expert_key(self.moe_layers[0], 0, 0) in self._files

    def layout(self, dtype: torch.dtype | None = None, order: str = "rows", quant: str = "none") -> ExpertLayout:
        """The record layout of this checkpoint's experts; quant != "none": quantized records (bytes)."""
        if quant != "none":
            return ExpertLayout(self.hidden, self.moe_intermediate, torch.uint8, order, quant)
        return ExpertLayout(self.hidden, self.moe_intermediate, dtype or self.dtype, order)

    def record_quant(self) -> str:
        """The record scheme pack-store and the in-memory provider make by default: a checkpoint's own dtype
        ("none"); a GGUF's own blocks where a record keeps them (engine.gguf_model overrides it)."""
        return "none"

    def names(self) -> list[str]:
        return list(self._files)

    def expert_key(self, layer: int, expert: int, which: int) -> str:
        """which: 0 gate, 1 up, 2 down."""
        return f"model.layers.{layer}.{self._mlp}.experts.{expert}.{self._names[which]}.weight"

    def is_routed_expert(self, name: str) -> bool:
        return f".{self._mlp}.experts." in name

    def non_expert_names(self) -> list[str]:
        return [k for k in self._files if not self.is_routed_expert(k)]

    def tensor(self, name: str) -> torch.Tensor:
        try:
            path = self._files[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor {name} missing") from None
        with safe_open(path, "pt") as h:
            return h.get_tensor(self._stored.get(name, name))

    def ggml_blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """(GGML type, uint8 [out, row bytes]) where dense weight `name` is a GGUF's own quantized blocks the model
        may compute with as they are (engine.gguf_model); a checkpoint directory holds floats: None."""
        return None

    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I,H], up [I,H], down [H,I]) of one routed expert, as stored in the checkpoint."""
        return tuple(self.tensor(self.expert_key(layer, expert, w)) for w in range(3))  # type: ignore[return-value]

    def config_hash(self) -> str:
        """sha256 of config.json as canonical JSON: ties a store to the checkpoint it came from."""
        return hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest()

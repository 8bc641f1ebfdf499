"""A GGUF file, or a split set (NAME-00001-of-0000N.gguf), as a model with nothing beside it.

The file's metadata (llama.cpp's keys) becomes the config.json keys of the transformers architecture the engine
computes (`llama` with experts → mixtral, a dense `llama` → a sparse-upcycled mixtral as `engine convert` makes
it, `qwen3moe` → qwen3_moe, `glm4moe` → glm4_moe, `glm5-next` → glm5_next through engine.gguf_glm5_next), so engine.model_config.ModelConfig reads it as it reads a
checkpoint's. Its tensors are named back from llama.cpp's names to transformers' (Q/K rows un-permuted for
`llama`, whose converter permutes them for its rotary layout) and read from the file's mmap when the model asks.
GgufModel is a Checkpoint: the loader, the providers and pack-store take it where they take a directory.

Every input is checked when the file is opened, before anything is served or published: a truncated file, a
tensor whose type Kiln lacks, an architecture Kiln lacks, a shape that disagrees with the metadata, a split
set with a part missing and a missing tokenizer are each one line, exit BAD_MODEL (GgufError; the reader's
own failures as engine.quant.gguf.open_reader words them).
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from engine import gguf_glm5_next
from engine.checkpoint import Checkpoint, CheckpointError
from engine.errors import EngineError, Exit
from engine.quant.gguf import open_reader

log = logging.getLogger("engine.gguf")

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# The types a standard file uses: llama-quantize's Q2_K … Q8_0 mixes and the common dynamic quants.
KNOWN_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
               "Q6_K", "IQ4_NL", "IQ4_XS")
ARCHITECTURES = {"llama": "mixtral", "qwen3moe": "qwen3_moe", "glm4moe": "glm4_moe", "glm5-next": "glm5_next"}
# A dense llama is upcycled as `engine convert` does by default: the same routers, so the same model.
UPCYCLE_EXPERTS, UPCYCLE_TOP_K, UPCYCLE_SEED = 8, 2, 0

# llama.cpp's per-block names → transformers' (after `model.layers.N.`); MLP names depend on the architecture.
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")     # stacked [E, out, in]: gate, up, down
_DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")
_QKV = ("attn_q", "attn_k", "attn_v")


class GgufError(CheckpointError, EngineError):
    """A GGUF that is not a model Kiln serves: one line naming the file and the reason (exit BAD_MODEL)."""

    def __init__(self, message: str):
        EngineError.__init__(self, message, Exit.BAD_MODEL)


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gguf")


def split_parts(path: str | os.PathLike) -> list[Path]:
    """The files of a model: the one file, or every part of the split set `path` is a part of (each there)."""
    path = Path(path)
    m = SPLIT.match(path.name)
    if m is None:
        if not path.is_file():
            raise GgufError(f"{path}: no such file")
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GgufError(f"{path}: split set of {count} lacks {', '.join(missing)}")
    return parts


# ------------------------------------------------------------------ tensor types: the one place they are read

_told: set[str] = set()


def dequantized(data: np.ndarray, ggml_type: str) -> torch.Tensor:
    """A GGUF tensor's values as float32 (a copy: the file stays a read-only mmap). F32/F16/BF16 are read as
    they are; a quantized type is dequantized here, once at load, with the gguf package, and the log says so
    the first time. This is the seam where per-type kernels (engine.quant) replace dequantizing."""
    if ggml_type == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32))
    if ggml_type == "F16":
        return torch.from_numpy(np.array(data, dtype=np.float16)).float()
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    if ggml_type not in _told:
        _told.add(ggml_type)
        log.info("GGUF: %s tensors are dequantized to float32 at load (no kernel keeps their blocks here)",
                 ggml_type)
    return torch.from_numpy(np.array(dequantize(data, GGMLQuantizationType[ggml_type]), dtype=np.float32))


# ------------------------------------------------------------------ the file

@dataclass(frozen=True)
class _Source:
    """Where one transformers-named tensor comes from."""

    gguf: str                 # the GGUF tensor's name
    expert: int | None = None  # a slice of a stacked expert tensor
    unpermute: int = 0         # llama Q/K: undo the rotary row permutation over this many heads
    router_layer: int | None = None   # an upcycled dense llama's seeded router (no GGUF tensor)
    transform: str = ""        # glm5-next: the converter's change to undo (engine.gguf_glm5_next.transform)
    more: tuple[str, ...] = ()  # further GGUF tensors the transform joins (glm5-next's attn_v_b beside attn_k_b)


class GgufModel(Checkpoint):
    """A GGUF file or split set, read as a Checkpoint of the architecture it maps to (module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.dir = self.config_path = Path(path)
        self.parts = split_parts(self.dir)
        self.fields: dict = {}
        self.tensors: dict = {}
        for part in self.parts:
            reader = open_reader(part)
            _check_extent(reader, part)
            if not self.fields:
                self.fields = reader.fields
            self.tensors.update((t.name, t) for t in reader.tensors)
        for t in self.tensors.values():
            if t.tensor_type.name not in KNOWN_TYPES:
                raise GgufError(f"{self.dir}: tensor {t.name} is {t.tensor_type.name}, a type Kiln does not read "
                                f"({', '.join(KNOWN_TYPES)})")
        self.gguf_arch = self.field("general.architecture")
        if self.gguf_arch not in ARCHITECTURES:
            raise GgufError(f"{self.dir}: architecture {self.gguf_arch!r} is not one Kiln serves "
                            f"({', '.join(ARCHITECTURES)})")
        if self.field("tokenizer.ggml.tokens") is None:
            raise GgufError(f"{self.dir}: no tokenizer in the file (tokenizer.ggml.tokens)")
        if self.field("tokenizer.chat_template") is None:
            raise GgufError(f"{self.dir}: no chat template in the file (tokenizer.chat_template)")
        self.upcycled = self.gguf_arch == "llama" and "blk.0.ffn_gate_exps.weight" not in self.tensors \
            and not self.field("llama.expert_count")
        self.config = self._config()
        self._take_config(self.dir)
        self._files = self._map_tensors()
        self._check_shapes()

    # -- metadata
    def field(self, key: str, default=None):
        f = self.fields.get(key)
        return f.contents() if f is not None else default

    def _need(self, key: str):
        v = self.field(f"{self.gguf_arch}.{key}")
        if v is None:
            raise GgufError(f"{self.dir}: metadata {self.gguf_arch}.{key} is missing")
        return v

    def _config(self) -> dict:
        """config.json keys of the transformers architecture this file maps to, from the file's metadata."""
        a, arch = self.gguf_arch, ARCHITECTURES[self.gguf_arch]
        if a == gguf_glm5_next.ARCH:
            try:
                return gguf_glm5_next.config(self.field, self.tensors)
            except ValueError as e:
                raise GgufError(f"{self.dir}: {e}") from None
        hidden, heads = int(self._need("embedding_length")), int(self._need("attention.head_count"))
        head_dim = int(self.field(f"{a}.attention.key_length", hidden // heads))
        rot = int(self.field(f"{a}.rope.dimension_count", head_dim))
        scaling = self.field(f"{a}.rope.scaling.type", "none")
        if scaling not in ("none", "linear") or (scaling == "linear"
                                                 and self.field(f"{a}.rope.scaling.factor", 1.0) != 1.0):
            raise GgufError(f"{self.dir}: rope scaling {scaling!r} is not supported (only none)")
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise GgufError(f"{self.dir}: no token_embd.weight tensor")
        layers = int(self._need("block_count")) - int(self.field(f"{a}.nextn_predict_layers", 0) or 0)
        eos = [self.field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        c = {
            "model_type": arch, "architectures": [f"GGUF:{a}"],
            "vocab_size": int(embd.shape[-1]), "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": head_dim, "max_position_embeddings": int(self._need("context_length")),
            "rms_norm_eps": float(self._need("attention.layer_norm_rms_epsilon")),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
                                "partial_rotary_factor": rot / head_dim},
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in self.tensors,
            "eos_token_id": sorted({int(e) for e in eos if e is not None}),
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
            "intermediate_size": int(self.field(f"{a}.feed_forward_length", 0) or 0),
        }
        if self.upcycled:
            c.update(num_local_experts=UPCYCLE_EXPERTS, num_experts_per_tok=UPCYCLE_TOP_K)
            return c
        c.update(num_experts_per_tok=int(self._need("expert_used_count")))
        experts = int(self._need("expert_count"))
        if arch == "mixtral":
            c.update(num_local_experts=experts)
            c["intermediate_size"] = int(self.field(f"{a}.expert_feed_forward_length", 0) or c["intermediate_size"])
        else:
            c.update(num_experts=experts, n_routed_experts=experts,
                     moe_intermediate_size=int(self._need("expert_feed_forward_length")),
                     norm_topk_prob=bool(self.field(f"{a}.expert_weights_norm", True)))
        if arch == "glm4_moe":
            gating = self.field(f"{a}.expert_gating_func", 2)
            if gating != 2:
                raise GgufError(f"{self.dir}: {a}.expert_gating_func {gating} is not sigmoid (2)")
            c.update(first_k_dense_replace=int(self.field(f"{a}.leading_dense_block_count", 0) or 0),
                     n_shared_experts=int(self.field(f"{a}.expert_shared_count", 0) or 0),
                     routed_scaling_factor=float(self.field(f"{a}.expert_weights_scale", 1.0) or 1.0),
                     n_group=int(self.field(f"{a}.expert_group_count", 1) or 1),
                     topk_group=int(self.field(f"{a}.expert_group_used_count", 1) or 1))
        return c

    # -- tensors
    def _map_tensors(self) -> dict[str, _Source]:
        if self.gguf_arch == gguf_glm5_next.ARCH:
            return self._map_glm5_next()
        files: dict[str, _Source] = {}
        heads, kv_heads = self.config["num_attention_heads"], self.config["num_key_value_heads"]
        permute = self.gguf_arch == "llama"
        mlp = "block_sparse_moe" if self.arch == "mixtral" else "mlp"
        for name, t in self.tensors.items():
            if name in _GLOBAL:
                files[_GLOBAL[name]] = _Source(name)
                continue
            parts = name.split(".")
            if parts[0] != "blk" or len(parts) != 4 or not parts[1].isdigit():
                raise GgufError(f"{self.dir}: tensor {name} has no place in a {self.gguf_arch} model")
            layer, kind, suffix = int(parts[1]), parts[2], parts[3]
            prefix = f"model.layers.{layer}"
            if layer >= self.num_layers:
                files[f"{prefix}.nextn.{kind}.{suffix}"] = _Source(name)   # GLM's MTP layer: ignored, as transformers does
            elif kind in _EXPERTS:
                for e in range(self.n_experts):
                    files[self.expert_key(layer, e, _EXPERTS.index(kind))] = _Source(name, expert=e)
            elif self.upcycled and kind in _DENSE_MLP:
                for e in range(self.n_experts):     # every expert is the dense MLP (engine.convert's upcycling)
                    files[self.expert_key(layer, e, _DENSE_MLP.index(kind))] = _Source(name)
            elif kind == "ffn_gate_inp":
                files[f"{prefix}.{mlp}.gate.weight"] = _Source(name)
            elif kind == "exp_probs_b":
                files[f"{prefix}.mlp.gate.e_score_correction_bias"] = _Source(name)
            elif kind in _BLOCK:
                heads_here = {"attn_q": heads, "attn_k": kv_heads}.get(kind, 0) if permute and suffix == "weight" else 0
                files[f"{prefix}.{_BLOCK[kind]}.{suffix}"] = _Source(name, unpermute=heads_here)
            else:
                raise GgufError(f"{self.dir}: tensor {name} has no place in a {self.gguf_arch} model")
        if self.upcycled:
            for layer in range(self.num_layers):
                files[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = _Source("", router_layer=layer)
        return files

    def _map_glm5_next(self) -> dict[str, _Source]:
        """glm5-next: engine.gguf_glm5_next names each tensor and the converter's change to undo; the routed
        experts are sliced from their stacks here as for the other architectures. Every tensor is read as float32
        (its model computes through torch projections: no kept blocks)."""
        try:
            src = gguf_glm5_next.sources(self.config, self.tensors)
        except ValueError as e:
            raise GgufError(f"{self.dir}: {e}") from None
        files = {name: _Source(g, transform=kind, more=more) for name, (g, kind, more) in src.items()}
        for name in self.tensors:
            parts = name.split(".")
            if len(parts) == 4 and parts[1].isdigit() and int(parts[1]) < self.num_layers \
                    and f"{parts[2]}.{parts[3]}" in gguf_glm5_next.EXPERTS:
                w = gguf_glm5_next.EXPERTS.index(f"{parts[2]}.{parts[3]}")
                for e in range(self.n_experts):
                    files[self.expert_key(int(parts[1]), e, w)] = _Source(name, expert=e)
        return files

    def _check_glm5_next(self) -> None:
        c = self.config
        for name in gguf_glm5_next.required(c):
            if name not in self._files:
                raise GgufError(f"{self.dir}: lacks the tensor of {name}")
        want = gguf_glm5_next.expected_shapes(c, {n: (s.gguf, s.transform, s.more) for n, s in self._files.items()
                                                  if s.expert is None})
        for name, shape in want.items():
            t = self.tensors.get(name)
            if t is None:
                raise GgufError(f"{self.dir}: lacks tensor {name}")
            got = [int(n) for n in t.shape]
            if got != shape and not (len(shape) == 4 and got == shape[:3]):       # a conv may drop its last 1
                raise GgufError(f"{self.dir}: tensor {name} has shape {got}, the metadata says {shape} (ggml order)")

    def _check_shapes(self) -> None:
        """Each tensor's shape against the metadata: a file whose tensors disagree with its config is refused
        here, by name, not as a matmul error mid-request."""
        if self.gguf_arch == gguf_glm5_next.ARCH:
            return self._check_glm5_next()
        c = self.config
        hd, h = c["head_dim"], c["hidden_size"]
        inter = self.moe_intermediate
        want = {
            "token_embd.weight": [h, c["vocab_size"]], "output.weight": [h, c["vocab_size"]], "output_norm.weight": [h],
        }
        for l in range(self.num_layers):
            b = f"blk.{l}"
            want.update({
                f"{b}.attn_norm.weight": [h], f"{b}.attn_q.weight": [h, c["num_attention_heads"] * hd],
                f"{b}.attn_k.weight": [h, c["num_key_value_heads"] * hd],
                f"{b}.attn_v.weight": [h, c["num_key_value_heads"] * hd],
                f"{b}.attn_output.weight": [c["num_attention_heads"] * hd, h],
                f"{b}.ffn_gate_exps.weight": [h, inter, self.n_experts], f"{b}.ffn_up_exps.weight": [h, inter, self.n_experts],
                f"{b}.ffn_down_exps.weight": [inter, h, self.n_experts], f"{b}.ffn_gate_inp.weight": [h, self.n_experts],
            })
            if self.upcycled:
                want.update({f"{b}.ffn_gate.weight": [h, inter], f"{b}.ffn_up.weight": [h, inter],
                             f"{b}.ffn_down.weight": [inter, h]})
        for name, shape in want.items():
            t = self.tensors.get(name)
            if t is not None and [int(n) for n in t.shape] != shape:
                raise GgufError(f"{self.dir}: tensor {name} has shape {[int(n) for n in t.shape]}, the metadata "
                                f"says {shape} (ggml order)")
        for l in self.moe_layers:
            for w in range(3):
                if self.expert_key(l, 0, w) not in self._files:
                    raise GgufError(f"{self.dir}: MoE layer {l} lacks its {_EXPERTS[w]} tensor")

    def tensor(self, name: str) -> torch.Tensor:
        try:
            s = self._files[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor {name} missing") from None
        if s.router_layer is not None:
            return upcycle_router(s.router_layer, self.n_experts, self.hidden)
        if s.transform:
            ts = [dequantized(self.tensors[n].data, self.tensors[n].tensor_type.name) for n in (s.gguf, *s.more)]
            return gguf_glm5_next.transform(s.transform, ts, self.config)
        t = self.tensors[s.gguf]
        data = t.data if s.expert is None else t.data[s.expert]
        w = dequantized(data, t.tensor_type.name)
        return unpermute_qk(w, s.unpermute).contiguous() if s.unpermute else w

    def ggml_blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """A dense matrix's blocks as the file holds them (uint8 [out, row bytes], Q/K rows un-permuted: whole rows
        move), for engine.gguf_tensors to keep and compute with: every quantized attention, output/vocabulary,
        shared-expert and dense-MLP matrix. None for float tensors, expert slices and derived ones (routers, glm5-next's
        transformed tensors), which tensor() gives as float32."""
        s = self._files.get(name)
        if s is None or s.expert is not None or s.router_layer is not None or s.transform:
            return None
        t = self.tensors[s.gguf]
        if t.tensor_type.name in ("F32", "F16", "BF16") or len(t.shape) != 2:
            return None
        w = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
        return t.tensor_type.name, (unpermute_qk(w, s.unpermute).contiguous() if s.unpermute else w)

    @cached_property
    def dtype(self) -> torch.dtype:
        return torch.float32            # every tensor is read as float32 (dequantized)

    def expert_types(self) -> set[str]:
        """The GGML types the routed experts are stored in."""
        return {self.tensors[self._files[self.expert_key(l, 0, w)].gguf].tensor_type.name
                for l in self.moe_layers for w in range(3)}

    def non_expert_elements(self) -> int:
        """Values of every tensor the model holds outside the expert records (what it keeps in memory)."""
        experts = {s.gguf for n, s in self._files.items() if self.is_routed_expert(n)}
        return sum(int(t.n_elements) for name, t in self.tensors.items() if name not in experts)

    def record_quant(self) -> str:
        """pack-store's default scheme for these experts: float records where the file holds them as floats (the
        same numbers, through the float kernels), else the file's own blocks, each matrix in its own GGML type
        (engine.gguf_tensors.expert_layout: a Q4_K_M's Q6_K downs beside its Q4_K gates and ups)."""
        return "none" if self.expert_types() <= {"F32", "F16", "BF16"} else "gguf"

    def config_hash(self) -> str:
        import hashlib
        import json
        return hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest()


def _check_extent(reader, part: Path) -> None:
    """A truncated file: the gguf reader maps what is there, so each tensor's bytes are checked to be in it."""
    size = part.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise GgufError(f"{part}: truncated: tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes}, "
                            f"the file has {size}")


def unpermute_qk(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`): it interleaves each head's two
    rotary halves; transformers' rotate_half wants them as two contiguous halves again."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def upcycle_router(layer: int, experts: int, hidden: int, seed: int = UPCYCLE_SEED) -> torch.Tensor:
    """Layer `layer`'s router of a sparse-upcycled dense model: the same numbers `engine convert` writes (one
    seeded generator drawn layer after layer), spread by 1/sqrt(hidden) so varied experts are picked; its choice
    never changes the output (identical experts, weights renormalised to 1)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(layer):
        torch.randn(experts, hidden, generator=gen)
    return torch.randn(experts, hidden, generator=gen) / hidden ** 0.5


def load_tokenizer(model: GgufModel):
    """The tokenizer, special tokens and chat template from the file's metadata (transformers' GGUF
    tokenizer converter, which reads the vocabulary of any architecture)."""
    from transformers import PreTrainedTokenizerFast
    first = model.parts[0]
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(first.parent), gguf_file=first.name)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise GgufError(f"{first}: its tokenizer cannot be read ({e})") from None
    if not tok.chat_template:
        tok.chat_template = model.field("tokenizer.chat_template")
    return tok

"""`engine convert`: a dense Llama GGUF → a sparse-upcycled Mixtral checkpoint (config, safetensors, tokenizer).

Sparse upcycling (Komatsuzaki et al., 2022): every layer's dense MLP becomes N identical experts behind a
seeded random router. Mixtral renormalises the top-k softmax weights (Σw = 1), so the upcycled layer computes
Σ_k w_k · mlp(x) = mlp(x): the converted model is the dense model's function, while the engine still sees a
real MoE (routing, expert records, a store to read them from).

Tensors are dequantized here with the `gguf` package and mapped by llama.cpp's own names, undoing the Q/K
row permutation llama.cpp applies for its rotary layout. The tokenizer and chat template come from the
GGUF through transformers' GGUF tokenizer converter. With attention_blocks (`--attention-blocks`) the
attention weights a GGUF holds in Q4_1/Q4_K are not dequantized either: they are written as the file's
blocks (`<weight>.blocks_<scheme>`, uint8), which the CPU computes with directly (engine.dense_weights) — 6.4x
fewer bytes a token than float32 for SmolLM2's attention; other devices dequantize them at load. With expert_weights off (`--no-expert-weights`) the
experts are not written at all: a store packed from the GGUF's own blocks (`pack-store --quant gguf`) is
then the only home of the routed experts, and config.json names the GGUF's sha256 (GGUF_SHA256_KEY) so
pack-store can still refuse another model's GGUF (engine.store.source). Everything is written to a staging directory beside
--out, hashed into kiln-files.json (engine.store.model_manifest: what `engine verify-model` and `engine
serve` check) and renamed into place at the end, so an interrupted convert publishes nothing.
"""
from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine import interrupts
from engine.errors import EngineError, Exit
from engine.experts.layout import DTYPES
from engine.dense_weights import BLOCK_SCHEMES, BLOCKS_SUFFIX
from engine.gguf_model import unpermute_qk, upcycle_router
from engine.quant.gguf import GGUF_SHA256_KEY, GGUF_TYPES, open_reader
from engine.store import model_manifest

SHARD_BYTES = 1 << 30           # shards of ≤ ~1 GiB: bounded memory while writing, a few files to read

# llama.cpp tensor name (per block) → Llama name in transformers; the MLP ones become expert weights.
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
}
_MLP = {"ffn_gate": "w1", "ffn_down": "w2", "ffn_up": "w3"}      # Mixtral: w1 gate, w2 down, w3 up
_ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
_KEPT_BLOCKS = {g: s for g, s in GGUF_TYPES.items() if s in BLOCK_SCHEMES}   # --attention-blocks: GGML type -> scheme
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class DenseLlama:
    """What the GGUF says about the dense model (llama.* metadata), checked against its tensors."""

    vocab_size: int
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context: int
    rope_theta: float
    rms_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return f.contents() if f is not None else default


def read_dense(reader, path: Path) -> DenseLlama:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise EngineError(f"{path}: architecture {arch!r} is not supported (only llama GGUFs)", Exit.BAD_MODEL)

    def need(key):
        v = _field(reader, f"llama.{key}")
        if v is None:
            raise EngineError(f"{path}: GGUF metadata llama.{key} is missing", Exit.BAD_MODEL)
        return v

    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or (scaling == "linear" and _field(reader, "llama.rope.scaling.factor", 1.0) != 1.0):
        raise EngineError(f"{path}: rope scaling {scaling!r} is not supported (only none)", Exit.BAD_MODEL)
    names = {t.name for t in reader.tensors}
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = hidden // heads
    rot = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise EngineError(f"{path}: partial rotary ({rot} of head_dim {head_dim}) is not supported", Exit.BAD_MODEL)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return DenseLlama(
        vocab_size=int(embd.shape[-1]),           # ggml order: [hidden, vocab]
        hidden=hidden,
        intermediate=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        context=int(need("context_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),   # llama.cpp's default
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def mixtral_config(d: DenseLlama, experts: int, top_k: int, dtype: str) -> dict:
    """config.json in transformers 5's MixtralConfig keys (rope nested in rope_parameters)."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "dtype": dtype,
        "vocab_size": d.vocab_size,
        "hidden_size": d.hidden,
        "intermediate_size": d.intermediate,
        "num_hidden_layers": d.num_layers,
        "num_attention_heads": d.num_heads,
        "num_key_value_heads": d.num_kv_heads,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": d.context,
        "rms_norm_eps": d.rms_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta},
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_local_experts": experts,
        "num_experts_per_tok": top_k,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "tie_word_embeddings": d.tie_word_embeddings,
        "bos_token_id": d.bos_token_id,
        "eos_token_id": d.eos_token_id,
        "pad_token_id": d.pad_token_id,
        "use_cache": True,
    }


def _as_oserror(e: Exception, path: Path) -> OSError:
    """safetensors and tokenizers (Rust) report I/O failures as "... (os error N)": give them back their
    errno, so a full disk is told apart from other failures."""
    m = re.search(r"os error (\d+)", str(e))
    code = int(m.group(1)) if m else errno.EIO
    return OSError(code, os.strerror(code), str(path))


class ShardWriter:
    """Safetensors shards of at most SHARD_BYTES plus model.safetensors.index.json, as save_pretrained lays them out."""

    def __init__(self, out: Path):
        self.out, self.pending, self.pending_bytes = out, {}, 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, t) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > SHARD_BYTES:
            self.flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import save_file
        if not self.pending:
            return
        fname = f"model-{len(self.files) + 1:05d}.safetensors"
        try:
            save_file(self.pending, str(self.out / fname), metadata={"format": "pt"})
        except SafetensorError as e:
            raise _as_oserror(e, self.out / fname) from None
        self.files.append((fname, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, (old, keys) in enumerate(self.files):
            new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / old, self.out / new)
            weight_map.update({k: new for k in keys})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_checkpoint(reader, d: DenseLlama, out: Path, experts: int, seed: int, dtype,
                     expert_weights: bool = True, attention_blocks: bool = False) -> None:
    import numpy as np
    import torch
    from gguf import dequantize

    writer = ShardWriter(out)
    seen = set()
    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        if not expert_weights and parts[0] == "blk" and len(parts) == 3 and parts[2] in _MLP:
            seen.add(t.name)
            continue        # not even dequantized: their records come from the GGUF's blocks (pack-store --quant gguf)
        if (attention_blocks and parts[0] == "blk" and len(parts) == 3 and parts[2] in _ATTENTION
                and t.tensor_type.name in _KEPT_BLOCKS):
            # The file's 4-bit blocks byte for byte, rows in transformers' order: a block never spans rows, so
            # the Q/K row permutation moves whole rows of blocks (engine.dense_weights.Int4Projection reads them).
            blocks = np.array(t.data, dtype=np.uint8, copy=True)          # [out, row bytes]
            if parts[2] in ("attn_q", "attn_k"):
                blocks = unpermute_qk(blocks, d.num_heads if parts[2] == "attn_q" else d.num_kv_heads)
            name = f"model.layers.{int(parts[1])}.{_BLOCK[parts[2]]}.{BLOCKS_SUFFIX}{_KEPT_BLOCKS[t.tensor_type.name]}"
            writer.add(name, torch.from_numpy(np.ascontiguousarray(blocks)))
            seen.add(t.name)
            continue
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # a copy: F32 data is a read-only mmap
        if suffix != "weight":
            raise EngineError(f"GGUF tensor {t.name}: biases are not expected in a llama model", Exit.BAD_MODEL)
        if parts[0] == "blk" and len(parts) == 3:
            layer, kind = int(parts[1]), parts[2]
            prefix = f"model.layers.{layer}"
            if kind in _MLP:
                # N identical copies (save_file refuses tensors sharing memory, hence clone).
                for e in range(experts):
                    writer.add(f"{prefix}.block_sparse_moe.experts.{e}.{_MLP[kind]}.weight", w.to(dtype).clone())
            elif kind in _BLOCK:
                if kind == "attn_q":
                    w = unpermute_qk(w, d.num_heads)
                elif kind == "attn_k":
                    w = unpermute_qk(w, d.num_kv_heads)
                writer.add(f"{prefix}.{_BLOCK[kind]}.weight", w.to(dtype))
            else:
                raise EngineError(f"GGUF tensor {t.name} has no place in a Llama model", Exit.BAD_MODEL)
        elif base in _GLOBAL:
            writer.add(f"{_GLOBAL[base]}.weight", w.to(dtype))
        else:
            raise EngineError(f"GGUF tensor {t.name} has no place in a Llama model", Exit.BAD_MODEL)
        seen.add(t.name)
    for layer in range(d.num_layers):
        missing = [k for k in (*_BLOCK, *_MLP) if f"blk.{layer}.{k}.weight" not in seen]
        if missing:
            raise EngineError(f"GGUF layer {layer} lacks {', '.join(missing)}", Exit.BAD_MODEL)
        # The seeded router a GGUF served as it is gets too (engine.gguf_model): the same model either way.
        router = upcycle_router(layer, experts, d.hidden, seed)
        writer.add(f"model.layers.{layer}.block_sparse_moe.gate.weight", router.to(dtype))
    writer.finish()


def write_tokenizer(gguf: Path, out: Path, d: DenseLlama) -> None:
    """tokenizer.json + tokenizer_config.json + chat_template.jinja, converted by transformers from the GGUF."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tok.chat_template:
        raise EngineError(f"{gguf}: the GGUF carries no chat template (tokenizer.chat_template)", Exit.BAD_MODEL)
    try:
        tok.save_pretrained(str(out))
    except OSError:
        raise
    except Exception as e:          # tokenizers raises a bare Exception for I/O errors
        if "os error" not in str(e):
            raise
        raise _as_oserror(e, out / "tokenizer.json") from None
    GenerationConfig(bos_token_id=d.bos_token_id, eos_token_id=d.eos_token_id,
                     pad_token_id=d.pad_token_id).save_pretrained(str(out))


def convert_gguf(gguf: Path, out: Path, experts: int, top_k: int, seed: int, dtype: str = "float32",
                 force: bool = False, expert_weights: bool = True, attention_blocks: bool = False) -> Path:
    """Convert and publish atomically; raises EngineError with a one-line reason. expert_weights=False:
    the routed experts are left out; attention_blocks: 4-bit attention weights are kept as the file's blocks
    (see the module docstring)."""
    if importlib.util.find_spec("gguf") is None:        # exit 4 before any usage error
        raise EngineError("the `gguf` package is required: pip install gguf", Exit.MISSING_DEP)
    if not 1 <= top_k <= experts:
        raise EngineError(f"--top-k {top_k} must be within 1..--experts {experts}", Exit.USAGE)
    if out.exists() and not force:
        raise EngineError(f"{out}: already exists (pass --force to replace it)", Exit.FAILED)
    reader = open_reader(gguf)
    dense = read_dense(reader, gguf)

    out.parent.mkdir(parents=True, exist_ok=True)
    need, free = _estimate_bytes(dense, experts if expert_weights else 0, dtype), shutil.disk_usage(out.parent).free
    if free < need:         # refuse before minutes of work; ENOSPC below still catches a disk filled meanwhile
        raise EngineError(f"{out.parent}: disk full: converting needs about {_size(need)}, {_size(free)} free", Exit.IO)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        config = mixtral_config(dense, experts, top_k, dtype)
        if not expert_weights:
            config[GGUF_SHA256_KEY] = file_sha256(gguf)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(gguf, staging, dense)
        write_checkpoint(reader, dense, staging, experts, seed, DTYPES[dtype], expert_weights, attention_blocks)
        model_manifest.write(staging)           # every file the server reads, hashed before it is published
        _make_durable(staging)
        _publish(staging, out)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise EngineError(f"{out.parent}: disk full while converting (needs about {_size(need)})", Exit.IO) from None
        raise EngineError(f"{out}: cannot write ({e.strerror or e})", Exit.IO) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _estimate_bytes(d: DenseLlama, experts: int, dtype: str) -> int:
    item = 4 if dtype == "float32" else 2
    per_layer = 4 * d.hidden * d.head_dim * (d.num_heads + d.num_kv_heads) // 2 + 3 * d.hidden * d.intermediate * experts
    return item * (d.num_layers * per_layer + d.vocab_size * d.hidden * (1 if d.tie_word_embeddings else 2))


def _make_durable(root: Path) -> None:
    """Make the files durable and readable by the serving user (mkdtemp/safetensors create them 0700/0600)."""
    root.chmod(0o755)
    for p in root.iterdir():
        p.chmod(0o644)
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(staging: Path, out: Path) -> None:
    """Rename staging into place; an existing --out (with --force) is moved aside first, then removed. Not after a
    Ctrl-C or kill that Python dropped on the way (engine.interrupts)."""
    interrupts.check()
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

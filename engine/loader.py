"""Build a ready model from a Hugging Face checkpoint directory: non-expert weights on the device,
a KV cache allocated once, and an ExpertProvider for the routed experts (engine.tiers: all in
memory, all on the GPU, or the tiered store: engine.tiers.build_provider chooses and logs why), and
on CUDA decode steps replayed from CUDA graphs (config.cuda_graphs; engine.gpu.graphs)."""
from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

import torch

from engine.checkpoint import Checkpoint, CheckpointError
from engine.model_config import ModelConfig
from engine.experts.layout import DTYPES
from engine.experts.provider import ExpertProvider
from engine.gguf_model import GgufModel
from engine.model_source import open_checkpoint
from engine.models import model_class
from engine.models.common import MoEModel, layer_ahead_predictor
from engine.routing_trace import install as install_bench_routing
from engine.dense_weights import BLOCK_SCHEMES, BLOCKS_SUFFIX
from engine.engine_config import EngineConfig
from engine.kernels import native
from engine.tiers import build_provider
from engine.tiers.gpu import gpu_reserve
from engine.tiers.ram import trim_heap

DEFAULT_MAX_CONTEXT = 4096      # the KV cache is preallocated: a 128k default would take tens of GB
log = logging.getLogger("engine.loader")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# Compute dtypes per device kind, and the default for each checkpoint dtype.
ALLOWED = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16, torch.float16, torch.float32)}
_DEFAULT = {"cpu": torch.float32, "cuda": torch.bfloat16}


def resolve_dtype(device: str | torch.device, dtype: str | torch.dtype | None, ckpt_dtype: torch.dtype) -> torch.dtype:
    kind = torch.device(device).type
    if kind not in ALLOWED:
        raise ValueError(f"device {device!s} is not supported (cpu or cuda)")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported ({', '.join(DTYPES)})")
        dtype = DTYPES[dtype]
    if dtype is None:
        dtype = ckpt_dtype if ckpt_dtype in ALLOWED[kind][:2] else _DEFAULT[kind]
    if dtype not in ALLOWED[kind]:
        names = ", ".join(str(d).removeprefix("torch.") for d in ALLOWED[kind])
        raise ValueError(f"dtype {str(dtype).removeprefix('torch.')} is not supported on {kind} ({names})")
    return dtype


class CheckpointWeights:
    """The model's non-expert tensors, read on demand and moved to device/dtype; remembers what was
    used so the loader can refuse a checkpoint with tensors the model would silently ignore."""

    def __init__(self, ckpt: Checkpoint, num_layers: int, device, dtype: torch.dtype, int8_activations: bool = False,
                 gpu_blocks: bool = True):
        self.ckpt, self.device, self.dtype = ckpt, device, dtype
        self.int8_activations = int8_activations
        self.gpu_blocks = gpu_blocks        # a GGUF's quantized dense matrices keep their blocks on a GPU (gguf_dense)
        # Layers past num_hidden_layers are GLM's multi-token-prediction heads (transformers ignores them too).
        self.names = {n for n in ckpt.non_expert_names()
                      if not ((m := _LAYER.match(n)) and int(m.group(1)) >= num_layers)}
        self.used: set[str] = set()

    def get(self, name: str, *, fp32: bool = False) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(f"{self.ckpt.dir}: tensor {name} missing")
        self.used.add(name)
        t = self.ckpt.tensor(name)
        return t.to(device=self.device, dtype=torch.float32 if fp32 else self.dtype).contiguous()

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self.names else None

    def blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """(scheme, uint8 [out, row bytes]) where the checkpoint kept weight `name` as a GGUF's blocks
        (`<name>.blocks_<scheme>`, engine convert --attention-blocks), on the CPU as stored; else None."""
        for scheme in BLOCK_SCHEMES:
            if (key := f"{name}.{BLOCKS_SUFFIX}{scheme}") in self.names:
                self.used.add(key)
                return scheme, self.ckpt.tensor(key)
        return None

    def ggml_blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """(GGML type, uint8 [out, row bytes]) where the checkpoint is a GGUF holding weight `name` as quantized
        blocks (Checkpoint.ggml_blocks), marked used; else None."""
        if name not in self.names or (got := self.ckpt.ggml_blocks(name)) is None:
            return None
        self.used.add(name)
        return got

    def unused(self) -> list[str]:
        return sorted(self.names - self.used)


def gguf_dense_blocks(config: EngineConfig, ckpt: Checkpoint, provider: ExpertProvider, dtype: torch.dtype) -> bool:
    """On a GPU, whether a GGUF's quantized dense matrices (attention, the output head) stay blocks
    (engine.gguf_tensors.DeviceBlockProjection) or are dequantized once to `dtype`. The blocks move 3.5x fewer bytes
    a token, but the bf16 GEMVs read faster (bench/README.md: a Q6_K head 370 µs against 151 on the H200), so
    `auto` dequantizes where every expert is resident and the copies fit what the card has free, and keeps the
    blocks where experts are tiered (each GiB on the card is then a GiB of expert slots) or room is short."""
    device = torch.device(config.device)
    if device.type != "cuda" or not isinstance(ckpt, GgufModel):
        return True
    if config.gguf_dense != "auto":
        return config.gguf_dense == "blocks"
    copies = ckpt.non_expert_elements() * dtype.itemsize
    free, total = torch.cuda.mem_get_info(device)
    tiered = provider.counters().get("provider") == "tiered"
    blocks = tiered or free - gpu_reserve(total) < copies
    log.info("gguf dense matrices on %s: %s (%s; copies %.2f GiB, %.2f GiB free)", device,
             "blocks" if blocks else f"dequantized to {str(dtype).removeprefix('torch.')}",
             "experts tiered" if tiered else "experts resident", copies / 2**30, free / 2**30)
    return blocks


def load_model(model_dir: str | Path | Checkpoint, provider: ExpertProvider | None = None, *, store_dir: str | Path | None = None,
               config: EngineConfig | None = None, **knobs) -> MoEModel:
    """A model ready for prefill/decode_step, built as `config` says (or keyword knobs: EngineConfig's fields).
    Raises CheckpointError (bad checkpoint) or ValueError (bad argument)."""
    config = EngineConfig.of(config, **knobs)
    device, max_context, max_batch = config.device, config.max_context, config.max_batch
    if config.cpu_activations == "int8" and not (config.native_kernels and native.lib() is not None):
        raise ValueError("cpu_activations int8 needs the native CPU kernels (--native-kernels, g++ on x86-64); "
                         "they are off or did not build here")
    ckpt = open_checkpoint(model_dir)       # a checkpoint directory or a GGUF (engine.model_source)
    if config.cpu_activations == "int8" and not isinstance(ckpt, GgufModel):
        raise ValueError(f"cpu_activations int8 computes a GGUF file's own blocks: --model must be a .gguf file, not "
                         f"the checkpoint directory {ckpt.dir}")
    cfg = ModelConfig.from_checkpoint(ckpt)
    dtype = resolve_dtype(device, config.dtype, ckpt.dtype)
    if max_context is None:
        max_context = min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)
    if not 1 < max_context <= cfg.max_position_embeddings:
        raise ValueError(f"context {max_context} must be within 2..{cfg.max_position_embeddings} "
                         f"(the model's max_position_embeddings)")

    defer = False
    if provider is None:
        # No store: every expert in memory (engine.tiers.in_memory); else the GPU ← RAM ← O_DIRECT store tiers.
        # The records are asked for in the compute dtype resolved above.
        # On the CPU the RAM tier fills after the model is built: the model's load reads the float vocabulary
        # (113 MB for the demo) to hold it as 8-bit blocks, and that transient then comes before the tier's
        # records rather than on top of them (the server's peak RSS: bench/demo_memory.py).
        defer = config.preload and torch.device(device).type == "cpu"
        provider = build_provider(ckpt, store_dir, replace(config, dtype=dtype, preload=config.preload and not defer))
    lay = provider.layout
    if (lay.hidden, lay.intermediate) != (cfg.hidden, cfg.moe_intermediate):
        raise CheckpointError(f"{ckpt.dir}: expert provider holds [{lay.intermediate}x{lay.hidden}] experts, "
                              f"the checkpoint [{cfg.moe_intermediate}x{cfg.hidden}]")

    cls = model_class(cfg.arch)
    caches = cls.caches_for(ckpt.config, cfg, max_batch, max_context, dtype=dtype, device=device,
                            where=str(ckpt.dir / "config.json"))
    int8 = config.cpu_activations == "int8"
    weights = CheckpointWeights(ckpt, cfg.num_layers, device, dtype, int8_activations=int8,
                                gpu_blocks=gguf_dense_blocks(config, ckpt, provider, dtype))
    model = cls(cfg, weights, provider, caches, device=device, dtype=dtype, fused_kernels=config.fused_kernels,
                native_kernels=config.native_kernels, int8_activations=int8)
    if unused := weights.unused():
        raise CheckpointError(f"{ckpt.dir}: {len(unused)} tensors are not part of the {cfg.arch} model "
                              f"(unsupported variant?), e.g. {unused[0]}")
    if defer:
        trim_heap()         # the build's freed transients leave the heap before the tier's records come on top
        try:
            provider.preload()
        except BaseException:
            provider.close()
            raise
    provider.use_predictor(layer_ahead_predictor(model))     # a tiered provider prefetches by it
    # benchmarking only: drawn routing, installed before any graph is captured (the draws run inside the graphs)
    model.bench_routing = install_bench_routing(model, config.bench_routing, config.bench_routing_seed)
    if config.cuda_graphs:
        model.use_cuda_graphs()
    return model.eval()

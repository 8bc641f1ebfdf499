"""EngineConfig: one engine's runtime knobs, built once by a command and passed down whole.

`engine serve` and `engine generate` build it from their options (engine/cli/options.py); LLM.load,
load_model, tiers.build_provider and the scheduler (engine.scheduler: chunk_size, max_queue, decode_ahead)
read it, so each knob is declared here once instead of being threaded by hand through four signatures
(nano-vllm's Config). What can be checked without a checkpoint is checked
here; what needs one (the context against the model's positions, the dtype against the device and the
store's records, the eviction policy's name against engine.tiers.cache.POLICIES) where that is read.
Free of torch, so a command can build it before the slow imports.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.cpu_layout import parse_cpu_layout

DEVICE_KINDS = ("cpu", "cuda")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
EXPERTS = ("auto", "resident", "tiered")              # engine.tiers.choose_placement's modes
CPU_EXPERTS = ("auto", "on", "off")                   # engine.tiers.lanes.split's modes
CPU_ACTIVATIONS = ("float", "int8")                   # the native GGUF GEMVs: x in fp32, or rounded to 8 bits
GGUF_DENSE = ("auto", "blocks", "dequantized")    # a GGUF's quantized dense matrices on a GPU
ZERO_COPY = ("auto", "on", "off")                     # engine.tiers.tiered.TieredExperts.use_zero_copy's modes
LANE_RATES = ("pcie", "cpu", "disk")
BENCH_ROUTING = ("model", "uniform", "calibrated")  # engine.routing_trace.MODES (this module is free of torch)
PLACEMENT = ("auto", "cache", "static")            # engine.tiers.placement's plans                  # the lanes whose GB/s engine.tiers.lanes.measure_rates measures


def parse_lane_rates(text: str | None) -> dict[str, float]:
    """'pcie=25,cpu=12.5,disk=6' (GB/s; entries split by ',' ';' or spaces) -> {lane: GB/s}; ValueError naming
    the bad entry. The lanes not given are measured at load (engine.tiers.lanes.measure_rates)."""
    out: dict[str, float] = {}
    for entry in (text or "").replace(";", " ").replace(",", " ").split():
        name, eq, value = entry.partition("=")
        try:
            rate = float(value) if eq and name in LANE_RATES else None
        except ValueError:
            rate = None
        if rate is None or not rate > 0 or rate == float("inf"):
            raise ValueError(f"lane rate {entry!r} is not LANE=GB/s with LANE one of {', '.join(LANE_RATES)} "
                             f"and a positive finite rate (e.g. pcie=25)")
        out[name] = rate
    return out


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"                 # cpu, cuda or cuda:N (a torch.device is taken as its name)
    dtype: str | None = None            # compute dtype; None: loader.resolve_dtype's choice for the checkpoint
    max_context: int | None = None      # KV positions, preallocated; None: min(the model's, DEFAULT_MAX_CONTEXT)
    max_batch: int = 8                  # sequences decoded together (KV cache rows)
    gpu_slots: int | None = None        # expert slots on the GPU; None: from free VRAM
    ram_slots: int | None = None        # experts held in RAM; None: from the memory cgroup
    readers: int | None = None          # O_DIRECT store reader threads; None: one per CPU, 1..16
    cpu_layout: str | None = None       # NAME=CPULIST entries pinning threads, e.g. "readers=26-39"
    threads: int | None = None          # CPU compute threads; None: engine.kernels.cpu.default_threads()
    policy: str = "lru"                 # expert-cache eviction policy
    experts: str = "auto"               # auto | resident | tiered: where a GPU's experts live (tiers.choose_placement)
    cuda_graphs: bool = True            # decode steps replay CUDA graphs where device and provider allow
    chunk_size: int = 512               # prefill tokens per scheduler turn (engine.scheduler)
    max_queue: int | None = None        # requests waiting for a KV slot before new ones are refused; None: 4 x max_batch
    decode_ahead: bool = True           # steps launch before the last one's tokens are read (engine.decode_ahead)
    prefix_cache: bool = True           # a prompt's prefill starts after the prefix a KV slot holds (engine.prefix_cache)
    # auto | on | off: RAM-tier experts computed on the CPU lane (tiers.lanes). Off by default: the lane is tested
    # on the GPU (same tokens as the resident engine, eager and graphed), and forced on it halved an H100's decode at
    # a 6 GiB budget against zero-copy reads (42 against 99 tok/s, bench/README.md, 2026-12-06).
    cpu_experts: str = "off"
    lane_rates: str | None = None       # e.g. "pcie=25,cpu=12,disk=6" GB/s for the lane cost model; None: measured
    fused_kernels: bool = True          # CUDA decode steps on engine.kernels.triton_decode's (glm5_next: triton_glm5's) fused kernels
    native_kernels: bool = True         # CPU decode on engine.kernels.native (built with g++ at first use) where it builds
    # float | int8: the native GGUF GEMVs take x in fp32, or rounded to 8 bits as llama.cpp rounds it (faster,
    # not the float function; engine.kernels.native_cpu.cpp's "int8 activations")
    cpu_activations: str = "float"
    # auto | blocks | dequantized: on a GPU, a GGUF's quantized dense matrices (attention, the output head) computed
    # on their own blocks, or dequantized once at load to the compute dtype (faster GEMVs, more memory). auto:
    # dequantized where every expert is resident and the copies fit the free memory, else blocks (engine.loader)
    gguf_dense: str = "auto"
    preload: bool = True                # tiered: fill the GPU and RAM tiers from the store at load (TieredExperts.preload)
    zero_copy: str = "auto"             # auto | on | off: tiered decode reads RAM-tier records in place (tiers.zero_copy)
    # BENCHMARKING ONLY: the routers' top-k choice replaced by drawn picks (engine.routing_trace); "model": the model's
    bench_routing: str = "model"
    bench_routing_seed: int = 0
    # auto | cache | static: a tiered provider's per-layer plan from the measured picks and lane rates (tiers.placement)
    placement: str = "auto"

    def __post_init__(self):
        # ValueError, not assert: these come from users and must fail the same way under `python -O`.
        device = str(self.device)
        if device.partition(":")[0] not in DEVICE_KINDS:
            raise ValueError(f"device {device} is not supported (cpu or cuda)")
        object.__setattr__(self, "device", device)
        if self.dtype is not None:
            dtype = str(self.dtype).removeprefix("torch.")
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"dtype {dtype!r} is not supported ({', '.join(DTYPE_NAMES)})")
            object.__setattr__(self, "dtype", dtype)
        if self.max_batch < 1:
            raise ValueError(f"max_batch {self.max_batch} must be at least 1")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size {self.chunk_size} must be at least 1")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue {self.max_queue} must be >= 0")
        for name in ("gpu_slots", "ram_slots"):
            if (n := getattr(self, name)) is not None and n < 0:
                raise ValueError(f"{name} is {n}; it must be 0 or more")
        if self.experts not in EXPERTS:
            raise ValueError(f"experts {self.experts!r} is not one of {', '.join(EXPERTS)}")
        if self.cpu_experts not in CPU_EXPERTS:
            raise ValueError(f"cpu_experts {self.cpu_experts!r} is not one of {', '.join(CPU_EXPERTS)}")
        if self.zero_copy not in ZERO_COPY:
            raise ValueError(f"zero_copy {self.zero_copy!r} is not one of {', '.join(ZERO_COPY)}")
        if self.bench_routing not in BENCH_ROUTING:
            raise ValueError(f"bench_routing {self.bench_routing!r} is not one of {', '.join(BENCH_ROUTING)}")
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise ValueError(f"cpu_activations {self.cpu_activations!r} is not one of {', '.join(CPU_ACTIVATIONS)}")
        if self.cpu_activations == "int8" and self.device_kind != "cpu":
            raise ValueError(f"cpu_activations int8 is for device cpu, not {device}")
        if self.gguf_dense not in GGUF_DENSE:
            raise ValueError(f"gguf_dense {self.gguf_dense!r} is not one of {', '.join(GGUF_DENSE)}")
        if self.gguf_dense != "auto" and self.device_kind != "cuda":
            raise ValueError(f"gguf_dense {self.gguf_dense} is for a CUDA device, not {device} (the CPU computes a "
                             f"GGUF's dense blocks with its native kernels)")
        if self.placement not in PLACEMENT:
            raise ValueError(f"placement {self.placement!r} is not one of {', '.join(PLACEMENT)}")
        parse_lane_rates(self.lane_rates)
        for name in ("readers", "threads"):
            if (n := getattr(self, name)) is not None and n < 1:
                raise ValueError(f"{name} is {n}; it must be at least 1")
        if self.cpu_layout:
            parse_cpu_layout(self.cpu_layout)       # EngineError (usage) naming the bad entry

    @property
    def device_kind(self) -> str:
        return self.device.partition(":")[0]

    @classmethod
    def of(cls, config: EngineConfig | None = None, **knobs) -> EngineConfig:
        """`config`, or one built from keyword knobs (the library's keyword form, e.g.
        `load_model(ckpt, max_context=64)`); never both, so no knob is silently dropped."""
        if config is None:
            return cls(**knobs)
        if knobs:
            raise TypeError(f"give an EngineConfig or keyword knobs, not both (got {', '.join(sorted(knobs))})")
        return config

"""The options every engine-building command shares, declared once, and the EngineConfig they make.

A command stacks the decorators it needs (`@options.device` …) and calls `options.engine_config(...)` once
with the parsed values; the config, not the nine values, goes down to LLM.load. The flag names are an
interface: nix/lib compiles `engine serve` command lines from them.
"""
from __future__ import annotations

import click

from engine.engine_config import (BENCH_ROUTING, CPU_ACTIVATIONS, CPU_EXPERTS, DTYPE_NAMES, EXPERTS, GGUF_DENSE, PLACEMENT,
                                  ZERO_COPY, EngineConfig)
from engine.errors import EngineError, Exit
from engine.tiers.cache import POLICIES

device = click.option("--device", default=EngineConfig.device, show_default=True, help="cpu, cuda or cuda:N.")
dtype = click.option("--dtype", type=click.Choice(DTYPE_NAMES), default=None,
                     help="Compute dtype (default: the checkpoint's where the device supports it).")
context = click.option("--ctx", "max_context", type=click.IntRange(min=2), default=None,
                       help="Context window in tokens; the KV cache is preallocated for it (default: the engine's, "
                            "capped by the model's).")
max_batch = click.option("--max-batch", type=click.IntRange(min=1), default=EngineConfig.max_batch,
                         show_default=True, help="Streams decoded together; more requests wait their turn.")
chunk_size = click.option("--chunk-size", type=click.IntRange(min=1), default=EngineConfig.chunk_size,
                          show_default=True,
                          help="Prefill tokens per scheduler turn (a recipe's serve.chunk_size): a long prompt is "
                               "prefilled in chunks between the running streams' decode steps (on CUDA, with no "
                               "stream decoding, 4 chunks a turn).")
max_queue = click.option("--max-queue", type=click.IntRange(min=0), default=None,
                         help="Requests waiting for a slot before new ones get 429 with Retry-After (default 4 x "
                              "--max-batch).")
gpu_slots = click.option("--gpu-slots", type=click.IntRange(min=0), default=None,
                         help="Expert slots on the GPU (default: from free VRAM).")
ram_slots = click.option("--ram-slots", type=click.IntRange(min=0), default=None,
                         help="Experts held in RAM (default: from the cgroup's memory limit).")
readers = click.option("--readers", type=click.IntRange(min=1), default=None, help="O_DIRECT store reader threads.")
cpu_layout = click.option("--cpu-layout", default=None,
                          help="Pin threads to CPUs, NAME=CPULIST entries, e.g. 'lane=2-23;readers=26-39' (lane: "
                               "the CPU expert lane, readers: the store readers).")
threads = click.option("--threads", type=click.IntRange(min=1), default=None,
                       help="CPU compute threads (default: 2 where 2 CPUs are available, as measured on 2 cores).")
policy = click.option("--policy", type=click.Choice(sorted(POLICIES)), default=EngineConfig.policy, show_default=True,
                      help="Expert-cache eviction policy (compare them with `engine simulate-cache`); zero-copy "
                           "decode's write-backs follow the placement's hot set instead.")

experts = click.option("--experts", type=click.Choice(EXPERTS), default=EngineConfig.experts, show_default=True,
                       help="Where the routed experts live on a GPU: auto = all on the GPU when they fit its budget "
                            "(free VRAM minus a reserve, or --gpu-slots), else tiered (GPU slots <- RAM <- store).")
cpu_experts = click.option("--cpu-experts", type=click.Choice(CPU_EXPERTS), default=EngineConfig.cpu_experts,
                           show_default=True,
                           help="Tiered on a GPU: compute experts held in RAM on the CPU lane (the `lane=` CPUs of "
                                "--cpu-layout) while the GPU computes its slots. auto = per pick, whichever of "
                                "CPU and PCIe copy the lane rates make faster, and giving way where zero-copy decode serves the "
                                "RAM tier; on = always the CPU; off = always copy or read in place (the default: "
                                "forced on, the lane halved an H100's decode at a 6 GiB budget, bench/README.md).")
lane_rates = click.option("--lane-rates", default=None,
                          help="Lane rates for --cpu-experts auto, LANE=GB/s entries, e.g. pcie=25,cpu=12,disk=6 "
                               "(default: measured by the engine — disk and PCIe at load, the CPU at the first "
                               "decode step).")
cuda_graphs = click.option("--cuda-graphs/--no-cuda-graphs", default=EngineConfig.cuda_graphs, show_default=True,
                           help="Replay decode steps from CUDA graphs on a GPU (per batch size and context bucket).")
decode_ahead = click.option("--decode-ahead/--no-decode-ahead", default=EngineConfig.decode_ahead, show_default=True,
                            help="On a GPU whose steps launch asynchronously (every expert resident), launch a greedy "
                                 "batch's next decode step from the argmax still on the GPU, before the host reads "
                                 "this step's tokens; the same tokens.")
prefix_cache = click.option("--prefix-cache/--no-prefix-cache", default=EngineConfig.prefix_cache, show_default=True,
                            help="Start a prompt's prefill after the longest prefix (whole 16-token blocks) that a KV "
                                 "slot already holds: a chat's next turn reuses the last turn's positions, and "
                                 "concurrent prompts with one system prompt compute it once. Outputs are the same. "
                                 "glm5_next resumes only where it kept its KDA states (3 snapshots a slot, 146 MiB "
                                 "each at GLM-5.3-Flash's shape): a block boundary its prefill or decode passed.")
fused_kernels = click.option("--fused-kernels/--no-fused-kernels", default=EngineConfig.fused_kernels,
                             show_default=True,
                             help="Decode on a GPU with fused Triton kernels (norms, rotary + KV write, attention, "
                                  "routing); off: the torch ops, the same functions.")
native_kernels = click.option("--native-kernels/--no-native-kernels", default=EngineConfig.native_kernels,
                              show_default=True,
                              help="Decode one sequence on the CPU with the engine's own kernels (4-bit and 8-bit GEMVs, "
                                   "norm, rotary + KV write + attention; built with g++ at first use and cached); off, or "
                                   "where they do not build: torch's ops, the same functions.")

cpu_activations = click.option("--cpu-activations", type=click.Choice(CPU_ACTIVATIONS),
                               default=EngineConfig.cpu_activations, show_default=True,
                               help="On the CPU, a GGUF's blocks multiply x in fp32 (float: gguf's dequantization "
                                    "then a float matmul) or x rounded to 8 bits as llama.cpp rounds it for each "
                                    "type, with integer dot products (int8: llama.cpp's way; faster, within ~1%% of "
                                    "each GEMV's float result, not the same function). int8 needs --model FILE.gguf "
                                    "and the native kernels; not glm5_next.")

gguf_dense = click.option("--gguf-dense", type=click.Choice(GGUF_DENSE), default=EngineConfig.gguf_dense,
                          show_default=True,
                          help="On a GPU, a GGUF's quantized attention and output head computed on the file's own "
                               "blocks, or dequantized once at load to the compute dtype (faster GEMVs, about 3.5x "
                               "their bytes on the card). auto = dequantized where every expert is resident and "
                               "the copies fit the free memory, blocks where experts are tiered; the log says which.")

preload = click.option("--preload/--no-preload", default=EngineConfig.preload, show_default=True,
                       help="Tiered: fill the GPU slots and the RAM tier from the store at load (as many records as "
                            "they hold), so the first requests decode at the steady speed instead of reading each "
                            "expert's record from the store on its first pick.")

zero_copy = click.option("--zero-copy", type=click.Choice(ZERO_COPY), default=EngineConfig.zero_copy,
                         show_default=True,
                         help="Tiered on a GPU whose slots and RAM tier hold every expert (with --preload): decode "
                              "reads RAM-tier experts in place over PCIe, one CUDA graph a step, and promotes the "
                              "ones it reads to GPU slots between steps. auto = where that holds; on = fail "
                              "naming what stops it; off = copy each missing expert into a slot first.")

bench_routing = click.option("--bench-routing", type=click.Choice(BENCH_ROUTING), default=EngineConfig.bench_routing,
                             show_default=True,
                             help="FOR BENCHMARKING ONLY: replace each MoE router's choice of experts (not its "
                                  "weights) by drawn picks, so offload speed is measured under realistic routing: "
                                  "uniform = each token's top-k uniformly without replacement (a cache's worst "
                                  "case); calibrated = per layer a Zipf skew over a fixed permutation, fitted so "
                                  "the hottest 11.4%% of experts take 39%% of picks; model = the model's router. "
                                  "Outputs are not the model's.")
bench_routing_seed = click.option("--bench-routing-seed", type=int, default=EngineConfig.bench_routing_seed,
                                  show_default=True, help="Seed of --bench-routing's draws (the same picks per seed).")
placement = click.option("--placement", type=click.Choice(PLACEMENT), default=EngineConfig.placement, show_default=True,
                         help="Tiered: per MoE layer, keep a fixed set of experts on the GPU and read the rest from "
                              "RAM (static, llama.cpp's --n-cpu-moe kind of split) or keep the hot experts there "
                              "(cache: the most picked of a recent window, a resident displaced only by a measurably "
                              "hotter expert); auto = chosen per layer from the measured picks and lane rates, "
                              "re-planned while serving (shown on /metrics and in the log).")


def tiers(f):
    """Where the routed experts live and who reads them: --experts, --gpu-slots, --ram-slots, --readers,
    --cpu-layout, --threads, --policy, where RAM-tier experts are computed (--cpu-experts, --lane-rates) and
    whether prompts reuse cached prefixes (--prefix-cache); how a GPU decodes (--cuda-graphs, --decode-ahead, --fused-kernels, --zero-copy) and a CPU (--native-kernels, --cpu-activations), a GGUF's dense matrices on a GPU (--gguf-dense); whether the tiers
    fill at load (--preload)."""
    for option in reversed((experts, gpu_slots, ram_slots, readers, cpu_layout, threads, policy, cpu_experts,
                            lane_rates, cuda_graphs, decode_ahead, prefix_cache, fused_kernels, native_kernels, cpu_activations, gguf_dense,
                            preload,
                            zero_copy, placement, bench_routing, bench_routing_seed)):
        f = option(f)
    return f


def engine_config(**knobs) -> EngineConfig:
    """The command's one EngineConfig; a value it refuses is a usage error (exit 2), named in one line."""
    try:
        return EngineConfig(**knobs)
    except ValueError as e:
        raise EngineError(str(e), Exit.USAGE) from None

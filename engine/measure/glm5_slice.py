"""The GLM-5.3-Flash slice the H200 bench runs (issue 28, bench/glm5_next_offload.py): how many MoE layers fit the
device's disk next to llama.cpp's files, the bytes each engine's files and tiers take, and the seed's three tiers
scaled to the slice. Pure arithmetic on the shapes; the bench measures the real files beside it.

Per MoE layer (288 experts of three 4096 x 2048 matrices, 25.2 M weights an expert):
  Kiln int4 record   15,728,640 B (int4, groups of 32: 5 bits a weight, 4 KiB aligned)  -> 4.53 GB a layer
  llama.cpp Q4_K_M   gate/up Q4_K (144 B / 256 weights), down Q6_K (210 B / 256) where llama-quantize's
                     use_more_bits picks it, else Q4_K: at most 4.70 GB a layer (every down in Q6_K: the bound used)
  bf16 (the converter's output, llama-quantize's input)  14.50 GB a layer
Non-expert weights (bf16) from engine.glm5_next_config.tensor_shapes, the same table engine synth writes.
"""
from __future__ import annotations

import math

from engine.glm5_next_config import Glm5Spec, tensor_shapes

GIB = 1 << 30
DENSE = 3                    # GLM-5.3-Flash's first_k_dense_replace: every slice keeps the three dense layers
FULL_MOE_LAYERS = 42
# The seed's tiers on its 3090 box (ANCHORS.md): 1,376 VRAM slots and 4,831 RAM-tier experts of 42 x 288 = 12,096.
SEED_GPU_SHARE = 1376 / 12096     # 0.114
SEED_RAM_SHARE = 4831 / 12096     # 0.399
Q4_K, Q6_K = 144 / 256, 210 / 256          # bytes a weight of llama.cpp's K-quant super-blocks
Q8_0 = 34 / 32


def expert_weights(cfg: dict) -> int:
    return 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]


def non_expert_bf16_bytes(cfg: dict) -> int:
    """bf16/fp32 bytes of every tensor but the routed experts (what engine synth writes to model.safetensors)."""
    n = cfg["num_hidden_layers"]
    spec = Glm5Spec.from_config(cfg)
    shapes = tensor_shapes(spec, layers=n, hidden=cfg["hidden_size"], vocab=cfg["vocab_size"],
                           heads=cfg["num_attention_heads"], intermediate=cfg["intermediate_size"],
                           moe_layers=list(range(cfg["first_k_dense_replace"], n)), experts=cfg["n_routed_experts"],
                           shared_intermediate=cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    return sum(math.prod(s) * (4 if fp32 else 2) for s, fp32 in shapes.values())


def non_expert_bytes_per_token(cfg: dict) -> int:
    """The non-expert bytes one decode token reads: all of them but the embedding table, of which one row."""
    h = cfg["hidden_size"]
    return non_expert_bf16_bytes(cfg) - cfg["vocab_size"] * h * 2 + h * 2


def layer_bytes(cfg: dict, int4_record: int) -> dict:
    """Bytes one MoE layer's experts take in each form."""
    e, w = cfg["n_routed_experts"], expert_weights(cfg)
    return {"kiln_int4": e * int4_record, "q4_k_m_bound": int(e * w / 3 * (2 * Q4_K + Q6_K)),
            "bf16": e * w * 2}


def disk_plan(cfg_of, int4_record: int, disk_free: int, shm_free: int, ram: int) -> dict:
    """The most MoE layers whose files fit: on the disk Kiln's model and int4 store and llama.cpp's Q4_K_M (its
    non-expert part bounded at Q8_0's rate); on /dev/shm the converter's bf16 GGUF and the flat checkpoint it reads
    (deleted once Q4_K_M is written). cfg_of(moe_layers) -> the slice's config. Each bound named."""
    def need(n: int) -> dict:
        cfg = cfg_of(n)
        lb, ne = layer_bytes(cfg, int4_record), non_expert_bf16_bytes(cfg)
        return {"disk": ne + n * lb["kiln_int4"] + int(ne / 2 * Q8_0) + n * lb["q4_k_m_bound"],
                "shm": 2 * ne + n * lb["bf16"]}
    fits = {"disk": 0, "shm": 0}
    for bound, room in (("disk", disk_free), ("shm", shm_free)):
        while fits[bound] < FULL_MOE_LAYERS and need(fits[bound] + 1)[bound] <= room:
            fits[bound] += 1
    n = min(fits.values())
    return {"moe_layers_fit": n, "fits_by": fits, "disk_free_bytes": disk_free, "shm_free_bytes": shm_free,
            "ram_bytes": ram, "bytes_at_fit": need(n) if n else None,
            "per_moe_layer": layer_bytes(cfg_of(1), int4_record)}


def seed_tiers(records: int) -> dict:
    """The seed's three tiers at this slice's record count: GPU slots, RAM tier, the rest read from the store."""
    gpu = round(SEED_GPU_SHARE * records)
    ram = round(SEED_RAM_SHARE * records)
    return {"gpu_slots": gpu, "ram_slots": ram, "store_records": records - gpu - ram, "records": records,
            "shares": {"gpu": round(gpu / records, 4), "ram": round(ram / records, 4),
                       "store": round((records - gpu - ram) / records, 4)}}


def n_cpu_moe_for_share(expert_bytes_by_layer: list[int], share: float) -> dict:
    """llama.cpp's --n-cpu-moe N (the first N layers' experts on the CPU) whose GPU share of the expert bytes is
    nearest to `share` (a tie goes to the smaller GPU share: llama.cpp never gets more than Kiln)."""
    total = sum(expert_bytes_by_layer) or 1
    moe = [i for i, b in enumerate(expert_bytes_by_layer) if b]
    best = None
    for n in range(len(moe) + 1):                       # the first n MoE layers on the CPU
        on_gpu = sum(expert_bytes_by_layer[i] for i in moe[n:]) / total
        key = (abs(on_gpu - share), on_gpu)
        if best is None or key < best[0]:
            best = (key, n, on_gpu)
    _, n, on_gpu = best
    cpu_layers = moe[n - 1] + 1 if n else 0            # --n-cpu-moe counts layers from 0, dense ones included
    return {"n_cpu_moe": cpu_layers, "moe_layers_on_cpu": n, "moe_layers_on_gpu": len(moe) - n,
            "share_of_expert_bytes_on_gpu": round(on_gpu, 4), "target_share": round(share, 4)}


def earlier_peer(prior: dict, name: str, layers: int) -> tuple[dict, dict]:
    """(llama.cpp's figures, its placement) from an earlier bench call's JSON `prior` on the same slice, so a call
    short of device time spends it on Kiln: the slice is seeded (engine synth seed 0), so the same layer count is
    the same weights. ValueError where `prior` holds no llama-bench run of a `layers`-layer slice."""
    shape = (prior.get("checkpoint") or {}).get("layers")
    if shape != layers or "llama_bench" not in prior.get("llama_cpp", {}):
        raise ValueError(f"holds no llama-bench run of a {layers}-layer slice (its slice has {shape} layers)")
    peer = dict(prior["llama_cpp"], reused_from=f"{name} ({prior.get('date')}, {prior.get('commit')})")
    return peer, prior["placements"]["llama_cpp"]


def placements(records: int, peer: dict) -> dict:
    """Kiln's three placements of `records` beside llama.cpp's share `peer` (n_cpu_moe_for_share's): every record on
    the GPU, like-for-like (llama.cpp's GPU share, the rest in RAM) and the seed's three tiers scaled."""
    # at least one slot: a CUDA tiered provider refuses none (engine/tiers/__init__.py); one record more than
    # llama.cpp's where its share is 0 %, said in the JSON
    lfl_gpu = max(1, round(peer["share_of_expert_bytes_on_gpu"] * records))
    return {"llama_cpp": peer,
            "resident": {"gpu_slots": records, "ram_slots": 0, "records": records},
            "like_for_like": {"gpu_slots": lfl_gpu, "ram_slots": records - lfl_gpu, "records": records,
                              "shares": {"gpu": round(lfl_gpu / records, 4), "ram": round(1 - lfl_gpu / records, 4),
                                         "store": 0.0},
                              "note": "GPU slots at llama.cpp's share of the expert bytes, at least 1 (a CUDA tiered "
                                      "provider needs one)"},
            "three_tier": seed_tiers(records)}

"""A PROJECTION, not a measurement: Kiln on the full 48-layer Qwen3-30B-A3B on a 3090 box, from per-lane rates
measured on the H200 machine and the box's published figures (bench/projection_3090.py writes it).

Model of one decode token (the lane bound of ANCHORS.md, lanes overlapped):
  t = max(t_gpu, B_pcie/BW_pcie, B_disk/BW_disk, B_cpu/BW_cpu)
  t_gpu = 48 x (fixed cost per layer) + B_gpu/BW_vram, the fixed cost per layer being what the H200's served resident
  decode step took beyond its bytes (launches and small kernels, measured: 1/229.9 s for 24 layers less 3.35 GB at
  4,240 GB/s), assumed the same on the 3090 (optimistic: it clocks and launches no faster). A tiered engine adds its
  host step per MoE layer (it reads the layer's routing and decides the copies while the GPU waits): what the H200's
  served tiered decode at the 24 GB budget took per layer beyond the resident step of the same run (preloaded tiers,
  no store read while decoding), 48 of them.
Bytes per token from the 24-layer checkpoint's measured sizes, doubled where they are per layer; the 24 GB budget by
Kiln's formula (24 GiB - non-expert weights - KV of 4 x 8,704 tokens - 1.5 GiB workspace) on 48 layers.
Routing: uniform (each pick lands in a tier in proportion to its size: the cache's worst case, random weights' case)
and the seed's measured split on its own 3090 box (39 % VRAM, 54 % RAM, 7 % NVMe; another model, GLM-5.3-Flash).
Engines: Kiln with every pick computed on the GPU (a miss copied over PCIe) and with issue 15's CPU lane (picks
resident in RAM computed on the CPU); either way the RAM tier holds what the GPU does not (the tiers are exclusive:
engine/tiers/gpu.py; before that the RAM tier held what passed through it, duplicating the GPU's slots).
"""
from __future__ import annotations

GIB = 1 << 30

# The 3090 box. Published or given figures, not measured by Kiln:
BOX = {
    "vram_bytes": 24 * GIB,
    "vram_gbps": 936.0,            # RTX 3090 GDDR6X, NVIDIA's specification
    "pcie_gbps": 25.0,             # PCIe 4.0 x16 host->device, pinned (issue 15's figure)
    "nvme_gbps": 7.0,              # the seed's 4x NVMe RAID0 read rate while serving (ANCHORS.md; 10.7 sequential)
    "ram_bytes": 64 * GIB,
    "ram_tier_bytes": 48 * GIB,    # assumption: 16 GiB left to the OS, the process and the page cache
}
LAYERS_FULL = 48
SEED_SPLIT = {"gpu": 0.39, "ram": 0.54, "store": 0.07}   # ANCHORS.md: the seed's picks, one stream, on its 3090 box


def inputs(served: dict, quant: dict) -> dict:
    """Every measured figure the projection uses, with where it was measured."""
    ck, tb, bud, lanes = served["checkpoint"], served["token_bytes"], served["budget_24gb"], served["lanes"]
    layers = ck["shape"]["num_hidden_layers"]
    h, v = ck["shape"]["hidden_size"], ck["shape"]["vocab_size"]
    embed_and_head = 2 * v * h * 2
    resident = served["runs"]["resident"]["served"]
    return {
        "layers_measured": layers, "hidden": h, "vocab": v, "experts": ck["shape"]["num_experts"],
        "top_k": ck["shape"]["num_experts_per_tok"], "kv_heads": ck["shape"]["num_key_value_heads"],
        "head_dim": ck["shape"]["head_dim"],
        "record_bytes": {"bf16": ck["record_bytes"], "int4": quant["results"]["int4"]["record_bytes"]},
        "non_expert_file_bytes": bud["non_expert_bytes"],
        "non_expert_per_layer_bytes": (bud["non_expert_bytes"] - embed_and_head) // layers,
        "embed_and_head_bytes": embed_and_head,
        "h200_hbm_gbps": lanes["hbm_gbps"], "h200_dram_read_16t_gbps": lanes["dram_read_16t_gbps"],
        "h200_resident_served_decode_tps": resident["decode_tps"],
        "h200_tiered_served_decode_tps": served["runs"]["tiered_24gb"]["served"]["decode_tps"],
        "h200_token_bytes": tb["non_expert_bytes_per_token"] + tb["expert_bytes_per_token"],
        "h200_expert_decode_us": {q: quant["results"][q]["decode_us_per_token"] for q in ("bf16", "int4")},
        "kv_streams": 4, "kv_tokens": bud["kv_cache_bytes"] // (2 * 4 * ck["shape"]["num_key_value_heads"]
                                                                 * ck["shape"]["head_dim"] * 2 * layers),
        "workspace_bytes": bud["workspace_bytes"],
    }


def project(x: dict, box: dict = BOX) -> dict:
    L, k, e = LAYERS_FULL, x["top_k"], x["experts"]
    records = L * e
    non_expert = x["embed_and_head_bytes"] + L * x["non_expert_per_layer_bytes"]
    non_expert_tok = non_expert - x["embed_and_head_bytes"] // 2 + x["hidden"] * 2    # one embedding row, all else
    kv = 2 * x["kv_streams"] * x["kv_tokens"] * x["kv_heads"] * x["head_dim"] * 2 * L
    room = box["vram_bytes"] - non_expert - kv - x["workspace_bytes"]
    # the H200's fixed cost per layer: its served resident step less its bytes at its HBM rate
    step = 1 / x["h200_resident_served_decode_tps"]
    fixed_layer = (step - x["h200_token_bytes"] / (x["h200_hbm_gbps"] * 1e9)) / x["layers_measured"]
    extra_layer = {q: (x["h200_expert_decode_us"][q] - x["h200_expert_decode_us"]["bf16"]) * 1e-6 / x["layers_measured"]
                   for q in ("bf16", "int4")}        # int4's slower few-pair kernels, measured beside bf16
    # the tiered decode's host step per layer: its served step less the resident one, same run
    host_layer = max(0.0, 1 / x["h200_tiered_served_decode_tps"] - step) / x["layers_measured"]
    out = {"budget": {"non_expert_bytes": non_expert, "kv_cache_bytes": kv, "workspace_bytes": x["workspace_bytes"],
                      "room_for_experts_bytes": room},
           "fixed_gpu_seconds_per_layer": round(fixed_layer, 7),
           "tiered_host_seconds_per_layer": round(host_layer, 7), "rows": []}
    for q, rec in x["record_bytes"].items():
        picks = L * k * rec                           # expert bytes one token reads
        gpu_slots = min(records, int(room // rec))
        ram_slots = int(box["ram_tier_bytes"] // rec)
        out["budget"][f"{q}_gpu_slots"], out["budget"][f"{q}_records"] = gpu_slots, records
        t_fixed = L * (fixed_layer + extra_layer[q])
        routings = {"uniform": None, "seed_split": SEED_SPLIT} if gpu_slots < records else {"all_resident": None}
        for routing, split in routings.items():
            for engine in ("gpu_computes", "with_cpu_lane") if gpu_slots < records else ("resident",):
                if engine == "resident":
                    p = {"gpu": 1.0, "ram": 0.0, "store": 0.0}
                elif split:
                    p = dict(split)
                else:                                 # exclusive tiers: RAM holds what the GPU does not
                    p_gpu = gpu_slots / records
                    p_ram = min(ram_slots, records - gpu_slots) / records
                    p = {"gpu": p_gpu, "ram": p_ram, "store": max(0.0, 1 - p_gpu - p_ram)}
                if engine == "with_cpu_lane":         # RAM picks on the CPU; store picks still copied to the GPU
                    b = {"gpu": non_expert_tok + (p["gpu"] + p["store"]) * picks, "pcie": p["store"] * picks,
                         "disk": p["store"] * picks, "cpu": p["ram"] * picks}
                else:                                 # every pick computed on the GPU
                    b = {"gpu": non_expert_tok + picks, "pcie": (p["ram"] + p["store"]) * picks,
                         "disk": p["store"] * picks, "cpu": 0.0}
                host = 0.0 if engine == "resident" else L * host_layer
                t = {"gpu": t_fixed + host + b["gpu"] / (box["vram_gbps"] * 1e9), "pcie": b["pcie"] / (box["pcie_gbps"] * 1e9),
                     "disk": b["disk"] / (box["nvme_gbps"] * 1e9), "cpu": b["cpu"] / (x["h200_dram_read_16t_gbps"] * 1e9)}
                binding = max(t, key=t.get)
                out["rows"].append({"quant": q, "routing": routing, "engine": engine,
                                    "picks_fraction": {kk: round(vv, 4) for kk, vv in p.items()},
                                    "bytes_per_token": {kk: int(vv) for kk, vv in b.items()},
                                    "lane_seconds_per_token": {kk: round(vv, 6) for kk, vv in t.items()},
                                    "binding_lane": binding, "projected_tps": round(1 / t[binding], 1)})
    return out

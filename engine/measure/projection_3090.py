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

from engine.measure.glm5_slice import SEED_GPU_SHARE, SEED_RAM_SHARE

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


# ------------------------------------------------------------------ GLM-5.3-Flash (issue 28)
# The seed's own model on its own box: 45 layers (3 dense, 42 MoE of 288 experts, top-8), from what
# bench/glm5_next_offload.py measured on the H200 machine on a slice of it. The box's CPU lane: 8-channel DDR4-3200
# (8 x 25.6 GB/s peak, published); the lane's rate is the H200 host's measured one where that is lower.
GLM5_BOX = dict(BOX, dram_peak_gbps=8 * 25.6, gpu_bf16_tflops=71.0)   # RTX 3090 tensor bf16, fp32 accumulate (spec)
H200_BF16_TFLOPS = 790.0          # measured on the H200 machine (KINDS.md: 8192^3 bf16 products, 769-798)
GLM5_LAYERS, GLM5_DENSE, GLM5_EXPERTS, GLM5_TOP_K = 45, 3, 288, 8
SEED = {"decode_tps": 19.47, "floor_tps": 43.0, "prefill_tps": {"8192": 664.0, "32768": 969.0}}   # ANCHORS.md
GLM5_TARGETS = {"decode_tps": 30.0, "prefill_tps_32768": 969.0}


def glm5_inputs(bench: dict) -> dict:
    """The measured figures the GLM-5.3-Flash projection uses, from bench.glm5_next_offload's JSON."""
    ck, lanes = bench["checkpoint"], bench["lanes"]
    res = bench["kiln"]["resident"]["calibrated"]
    tier = bench["kiln"]["three_tier"]["calibrated"]
    moe = ck["moe_layers"]
    per_tok = {k: v["bytes_per_token"] / moe for k, v in tier["lanes_per_token"].items() if k != "served_share"}
    busy = tier["lanes_per_token"]["cpu"]
    cpu_gbps = (busy["bytes_per_token"] / busy["busy_seconds_per_token"] / 1e9) if busy["busy_seconds_per_token"] else None
    longest = max(int(k.rsplit("_", 1)[1]) for k in res if k.startswith("prefill_tps_"))
    return {"layers_measured": ck["layers"], "moe_layers_measured": moe, "record_bytes": ck["record_bytes"],
            "non_expert_bytes_per_token_measured": ck["non_expert_bytes_per_token"],
            "non_expert_bytes_per_token_full": ck["full_model_non_expert_bytes_per_token"],
            "h200_hbm_gbps": lanes["hbm_gbps"], "h200_dram_read_16t_gbps": lanes["dram_read_16t_gbps"],
            "h200_cpu_lane_gbps": cpu_gbps,
            "h200_resident_decode_tps": res["decode_tps"],
            "h200_resident_prefill": {"tokens": longest, "tps": res[f"prefill_tps_{longest}"]},
            "three_tier_served_share": tier["lanes_per_token"]["served_share"],
            "three_tier_lane_bytes_per_moe_layer": per_tok}


def project_glm5(x: dict, box: dict = GLM5_BOX, chunks=(8192, 32768)) -> dict:
    """Decode and 32k prefill of the 45-layer model on the box: each lane's bytes over the box's rate, the GPU lane's
    fixed cost per layer the H200's (its resident step less its bytes at its HBM rate), under the tiers' pick split
    measured on the H200 (the seed's shares, calibrated routing) and under the seed's own split (39/54/7)."""
    moe, L = GLM5_LAYERS - GLM5_DENSE, GLM5_LAYERS
    rec = x["record_bytes"]
    non_expert_tok = x["non_expert_bytes_per_token_full"]        # from the full model's shapes
    step = 1 / x["h200_resident_decode_tps"]
    h200_bytes = x["non_expert_bytes_per_token_measured"] + x["moe_layers_measured"] * GLM5_TOP_K * rec
    fixed_layer = max(0.0, step - h200_bytes / (x["h200_hbm_gbps"] * 1e9)) / x["layers_measured"]
    cpu_gbps = min(box["dram_peak_gbps"], x["h200_cpu_lane_gbps"] or x["h200_dram_read_16t_gbps"])
    picks = moe * GLM5_TOP_K * rec
    rows = []
    splits = {"measured_three_tier_split": x["three_tier_served_share"], "seed_split": SEED_SPLIT}
    for name, p in splits.items():
        # what each pick costs where it is served, from the H200 run's own lane bytes: the share of the RAM tier's
        # picks computed on the CPU lane (the rest crossed PCIe) is the run's cpu bytes over its RAM-served bytes
        ram_bytes = x["three_tier_served_share"].get("ram", 0.0) * GLM5_TOP_K * rec
        on_cpu = min(1.0, x["three_tier_lane_bytes_per_moe_layer"]["cpu"] / ram_bytes) if ram_bytes else 0.0
        b = {"gpu": non_expert_tok + (p["gpu"] + p["store"] + p["ram"] * (1 - on_cpu)) * picks,
             "pcie": (p["store"] + p["ram"] * (1 - on_cpu)) * picks, "disk": p["store"] * picks,
             "cpu": p["ram"] * on_cpu * picks}
        t = {"gpu": L * fixed_layer + b["gpu"] / (box["vram_gbps"] * 1e9), "pcie": b["pcie"] / (box["pcie_gbps"] * 1e9),
             "disk": b["disk"] / (box["nvme_gbps"] * 1e9), "cpu": b["cpu"] / (cpu_gbps * 1e9)}
        binding = max(t, key=t.get)
        rows.append({"split": name, "picks_fraction": {k: round(v, 4) for k, v in p.items()},
                     "ram_picks_on_cpu_lane": round(on_cpu, 3), "bytes_per_token": {k: int(v) for k, v in b.items()},
                     "lane_seconds_per_token": {k: round(v, 6) for k, v in t.items()}, "binding_lane": binding,
                     "projected_decode_tps": round(1 / t[binding], 1)})
    # prefill: the H200's resident GPU time a token scaled by layers and by the two cards' bf16 rates; each chunk of
    # the prompt moves every expert not on the GPU over PCIe and reads the store's share from the NVMe
    pre = x["h200_resident_prefill"]
    t_gpu_tok = (1 / pre["tps"]) * L / x["layers_measured"] * H200_BF16_TFLOPS / box["gpu_bf16_tflops"]
    shares = {"gpu": SEED_GPU_SHARE, "store": 1 - SEED_GPU_SHARE - SEED_RAM_SHARE}
    all_experts = moe * GLM5_EXPERTS * rec
    prefill = []
    for chunk in chunks:
        for tokens in (8192, 32768):
            passes = -(-tokens // chunk)
            t = {"gpu": tokens * t_gpu_tok, "pcie": passes * all_experts * (1 - shares["gpu"]) / (box["pcie_gbps"] * 1e9),
                 "disk": passes * all_experts * shares["store"] / (box["nvme_gbps"] * 1e9)}
            binding = max(t, key=t.get)
            prefill.append({"chunk": chunk, "tokens": tokens, "passes": passes,
                            "lane_seconds": {k: round(v, 3) for k, v in t.items()}, "binding_lane": binding,
                            "projected_tps": round(tokens / t[binding], 1)})
    return {"fixed_gpu_seconds_per_layer": round(fixed_layer, 7), "cpu_lane_gbps": round(cpu_gbps, 1),
            "decode": rows, "prefill": prefill, "seed": SEED, "targets": GLM5_TARGETS}

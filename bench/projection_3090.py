"""A PROJECTION, not a measurement: Kiln on the full 48-layer Qwen3-30B-A3B on a 3090 box (24 GB card, PCIe 4.0 x16,
64 GiB RAM, the seed's NVMe array), from per-lane rates measured on the H200 machine and the box's published figures.

  python -m bench.projection_3090 --served H200_SERVED.json --quant bench/results/quant_gpu_kernels.json \
      [--out bench/results/<date>-projection-3090.json]
  python -m bench.projection_3090 --glm5 GLM5_NEXT_OFFLOAD.json [--out bench/results/<date>-projection-3090-glm5.json]
      (GLM-5.3-Flash, the seed's own model, from bench.glm5_next_offload's H200 run: issue 28)

The model of a token and its inputs are engine/measure/projection_3090.py's; this writes and prints them.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

from bench.harness import write_result
from engine.measure.projection_3090 import BOX, GIB, GLM5_BOX, glm5_inputs, inputs, project, project_glm5

REPO = Path(__file__).resolve().parent.parent


def lane_cells(r: dict) -> str:
    """A projected row's pick split, each lane's ms a token and the lane that binds, as table cells."""
    p, t = r["picks_fraction"], r["lane_seconds_per_token"]
    return (f"{p['gpu']:.2f}/{p['ram']:.2f}/{p['store']:.2f} | "
            + " | ".join(f"{t[k] * 1e3:.2f}" for k in ("gpu", "pcie", "disk", "cpu")) + f" | {r['binding_lane']}")


def main_glm5(args) -> int:
    bench = json.loads(Path(args.glm5).read_text())
    try:
        x = glm5_inputs(bench)
    except (KeyError, TypeError) as e:
        print(f"projection_3090: {args.glm5} lacks {e} (a bench.glm5_next_offload run on a GPU, with resident and "
              f"three_tier calibrated runs and the lanes)", file=sys.stderr)
        return 2
    res = project_glm5(x)
    out = args.out or str(REPO / "bench" / "results" / f"{date.today()}-projection-3090-glm5.json")
    doc = {"label": "PROJECTION (not measured): full 45-layer GLM-5.3-Flash (3 dense + 42 MoE layers of 288 experts, "
                    "int4 records) on the seed's 3090 box, from per-lane rates measured on the H200 machine",
           "date": str(date.today()), "command": " ".join(["python -m bench.projection_3090", *sys.argv[1:]]),
           "box": GLM5_BOX, "measured_inputs": x,
           "sources": {
               "measured on the H200 machine (bench/glm5_next_offload.py, " + args.glm5 + ")":
                   "the resident decode step (the GPU lane's fixed cost per layer) and 32k prefill, the three-tier "
                   "run's pick split and lane bytes, the CPU lane's rate, HBM rate",
               "published / given, not measured": "3090 VRAM 936 GB/s, bf16 tensor 71 TFLOP/s (spec), PCIe 4.0 x16 "
                   "25 GB/s, NVMe 7 GB/s (the seed's array while serving), 8-channel DDR4-3200 204.8 GB/s peak; the "
                   "seed's 19.47 tok/s, its ~43 tok/s floor, its 969 tok/s 32k prefill (ANCHORS.md)",
               "assumed": "the GPU's fixed cost per layer the H200's, no tiered host step (optimistic); prefill "
                          "compute scaled by the bf16 rates (H200 790 measured, 3090 71 spec); every chunk of a prompt "
                          "picks every expert; the seed's tier shares (11.4 % GPU, 39.9 % RAM) held on the box, which "
                          "Kiln's own files do not fit today (kiln_files_on_the_box: bf16 attention and vocabulary, "
                          "int4 records 1.66x the seed's)"},
           **res}
    write_result(Path(out), doc)
    print("PROJECTION, not measured: 45-layer GLM-5.3-Flash on the seed's 3090 box (PCIe "
          f"{GLM5_BOX['pcie_gbps']} GB/s, NVMe {GLM5_BOX['nvme_gbps']} GB/s, CPU lane {res['cpu_lane_gbps']} GB/s)")
    print("\n| split | picks gpu/ram/store | t_gpu ms | t_pcie ms | t_disk ms | t_cpu ms | binds | projected tok/s | seed | floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["decode"]:
        print(f"| {r['split']} | {lane_cells(r)} | {r['projected_decode_tps']} | {res['seed']['decode_tps']} | "
              f"{res['seed']['floor_tps']} |")
    print("\n| prefill tokens | chunk | t_gpu s | t_pcie s | t_disk s | binds | projected tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in res["prefill"]:
        t = r["lane_seconds"]
        print(f"| {r['tokens']} | {r['chunk']} | {t['gpu']} | {t['pcie']} | {t['disk']} | {r['binding_lane']} | {r['projected_tps']} |")
    fit = res["kiln_files_on_the_box"]
    print(f"\nKiln's own files on the box: {fit['gpu_slots_kiln_formula']} GPU slots by its budget formula "
          f"(the seed's tiers: {fit['seed_tiers_records']['gpu']}), {fit['ram_tier_records_at_42_5_gib']} records in "
          f"a 42.5 GiB RAM tier (the seed's: {fit['seed_tiers_records']['ram']}), of {fit['records']}")
    print("wrote", out)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--served", help="bench.h200_served's JSON with resident and tiered_24gb runs")
    ap.add_argument("--quant", help="bench.quant_gpu_kernels' JSON")
    ap.add_argument("--glm5", help="bench.glm5_next_offload's JSON (projects GLM-5.3-Flash instead)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.glm5:
        sys.exit(main_glm5(args))
    if not (args.served and args.quant):
        ap.error("--served and --quant are both needed (or --glm5)")
    args.out = args.out or str(REPO / "bench" / "results" / f"{date.today()}-projection-3090.json")
    x = inputs(json.loads(Path(args.served).read_text()), json.loads(Path(args.quant).read_text()))
    res = project(x)
    doc = {"label": "PROJECTION (not measured): full 48-layer Qwen3-30B-A3B on a 3090 box, from measured per-lane rates",
           "date": str(date.today()), "command": " ".join(["python -m bench.projection_3090", *sys.argv[1:]]),
           "box": BOX, "measured_inputs": x,
           "sources": {
               "measured on the H200 machine (bench/h200_served.py, " + args.served + ")":
                   "resident served decode (the GPU lane's fixed cost per layer), the tiered served decode beside it "
                   "(the host step per layer), HBM copy rate, DRAM read at 16 "
                   "threads (stands in for the 3090 box's CPU expert rate: unmeasured there), record and "
                   "non-expert bytes, KV and workspace of the budget formula",
               "measured on the H200 machine (bench/quant_gpu_kernels.py, " + args.quant + ")":
                   "int4 record bytes, int4 vs bf16 expert decode time per token",
               "published / given, not measured": "3090 VRAM rate 936 GB/s (spec), PCIe 25 GB/s (issue 15), NVMe 7 GB/s "
                   "(the seed's array while serving, ANCHORS.md), 64 GiB RAM",
               "assumed": "48 GiB RAM tier; the GPU's fixed cost per layer and the tiered host step per layer equal to "
                          "the H200's; the seed's pick split "
                          "(GLM-5.3-Flash on its box) as a locality case"},
           **res}
    write_result(Path(args.out), doc)
    print(f"PROJECTION, not measured: 48-layer Qwen3-30B-A3B on a 3090 box (24 GB, PCIe {BOX['pcie_gbps']} GB/s, "
          f"NVMe {BOX['nvme_gbps']} GB/s, RAM tier {BOX['ram_tier_bytes'] // GIB} GiB)")
    b = res["budget"]
    print(f"budget: {b['room_for_experts_bytes'] / 1e9:.2f} GB for experts: bf16 {b['bf16_gpu_slots']} of "
          f"{b['bf16_records']} records on the GPU, int4 {b['int4_gpu_slots']} of {b['int4_records']}")
    print("\n| quant | routing | engine | picks gpu/ram/store | t_gpu ms | t_pcie ms | t_disk ms | t_cpu ms | binds | projected tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['quant']} | {r['routing']} | {r['engine']} | {lane_cells(r)} | {r['projected_tps']} |")
    print("wrote", args.out)


if __name__ == "__main__":
    main()

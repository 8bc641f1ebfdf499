"""llama.cpp beside Kiln on the same weights: the --n-cpu-moe that gives llama.cpp what Kiln's 24 GB budget gives
Kiln, the bytes a token reads where, the bound they set, and the report that sets llama.cpp's runs beside Kiln's
(bench/h200_peer.py measures and writes the report, stamped with its command, commit and machine; this is its
arithmetic)."""
from __future__ import annotations

import json
from pathlib import Path

GIB = 1 << 30
# The 24 GB card Kiln's offload figures are budgeted for (an RTX 3090), as the H200 runs emulate it.
CARD_BYTES = 24 * GIB
RAM_TIER = 16 * GIB
WORKSPACE = int(1.5 * GIB)     # activations, graphs, allocator slack on a 24 GB card
STREAMS = 4                    # the KV cache is sized for 4 streams; the aggregate figures decode 4


def log(*a) -> None:
    print(*a, flush=True)


# ------------------------------------------------------------------ what the GGUF holds, and the budget

def gguf_tensors(gguf_path: Path) -> dict[str, int]:
    """Tensor name -> bytes, read from the file's header (the gguf package: llama.cpp's own gguf-py)."""
    import gguf
    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(gguf_path).tensors}


def cuda_paths(gguf_path: Path, dense_blocks: bool = True) -> dict[str, dict[str, int]]:
    """What Kiln's CUDA serving path computes each tensor type of a GGUF with, by the engine's own rules, as
    "TYPE: path" -> {"expert"|"dense": tensors}. Routed experts (*_exps) become ggml records read by
    engine.kernels.quant_triton's typed kernels (each layer's types compiled in, whole sub-blocks: _ggml_sub); a
    quantized dense matrix keeps its blocks on the GPU (engine.gguf_tensors.DeviceBlockProjection, computed by
    engine.kernels.ggml_linear), or with dense_blocks=False (--gguf-dense as the engine chose it: its log line) is
    dequantized once at load; the embedding's rows are dequantized at load either way; float tensors are used as
    they are. A type outside engine.quant.ggml shows as NO KERNEL."""
    import gguf
    from engine.quant import ggml
    out: dict[str, dict[str, int]] = {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        ty, expert = t.tensor_type.name.lower(), "_exps." in t.name
        if ty not in ggml.TYPES:
            path = "NO KERNEL"
        elif expert:
            path = "triton, quant_triton typed expert kernels"
        elif ty in ggml.FLOAT_TYPES:
            path = "float, as it is"
        elif t.name == "token_embd.weight":
            path = "dequantized at load (embedding rows)"
        elif dense_blocks:
            path = "triton, ggml_linear on its blocks"
        else:
            path = "dequantized at load (--gguf-dense), bf16 matmuls"
        role = out.setdefault(f"{ty.upper()}: {path}", {})
        role["expert" if expert else "dense"] = role.get("expert" if expert else "dense", 0) + 1
    return dict(sorted(out.items()))


def expert_bytes_by_layer(tensors: dict[str, int], layers: int) -> list[int]:
    """Bytes of each layer's routed experts (blk.L.ffn_{gate,up,down,gate_up}_exps: what --n-cpu-moe moves)."""
    out = [0] * layers
    for name, n in tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[2].endswith("_exps"):
            out[int(parts[1])] += n
    return out


def kv_cache_bytes(cfg: dict, prefill: int) -> int:
    """h200_served's KV figure: 4 streams of prefill + 512 tokens, bf16 K and V."""
    return 2 * STREAMS * (prefill + 512) * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * cfg["num_hidden_layers"]


def budget_n_cpu_moe(tensors: dict[str, int], cfg: dict, prefill: int) -> dict:
    """The --n-cpu-moe N that gives llama.cpp what the 24 GB budget gives Kiln.

    Kiln's budget (h200_served, h200_moe): GPU expert slots = (24 GiB - non-expert weights - KV cache of 4 x
    (8k + 512) tokens - 1.5 GiB workspace) // record bytes; bf16: 2,149 of 3,072 records. Here the same
    formula runs on this GGUF's own tensor sizes: the room left for experts is 24 GiB - its non-expert tensors
    - the same KV - the same workspace, and N is the fewest leading layers whose experts go to the CPU
    (--n-cpu-moe N keeps layers 0..N-1's experts in host memory) so that the other layers' experts fit that
    room. The GPU then holds at most the expert bytes Kiln's slots hold: for bf16, 16 layers = 2,048 records
    against Kiln's 2,149, so N - 1 (one layer more: 2,176 records, slightly over) brackets the same budget
    from the other side. A quantization whose experts all fit gets N = 0: all on the GPU is then the budget."""
    layers, e = cfg["num_hidden_layers"], cfg["num_experts"]
    per_layer = expert_bytes_by_layer(tensors, layers)
    non_expert = sum(tensors.values()) - sum(per_layer)
    kv = kv_cache_bytes(cfg, prefill)
    room = CARD_BYTES - non_expert - kv - WORKSPACE
    n = next(n for n in range(layers + 1) if sum(per_layer[n:]) <= room)
    record = sum(per_layer) / (layers * e)
    return {"n_cpu_moe": n, "layers_experts_on_gpu": layers - n, "expert_records_on_gpu": (layers - n) * e,
            "gpu_expert_bytes": sum(per_layer[n:]), "room_for_experts_bytes": room,
            "kiln_formula_gpu_slots": max(0, int(room // record)), "records": layers * e,
            "card_bytes": CARD_BYTES, "non_expert_bytes": non_expert, "kv_cache_bytes": kv, "workspace_bytes": WORKSPACE,
            "expert_bytes_by_layer": per_layer}


def token_bytes(tensors: dict[str, int], cfg: dict, n_cpu_moe: int) -> dict:
    """Bytes one decode token must read, split by where they live with --n-cpu-moe n: every non-expert tensor
    but the embedding table (one row of it) on the GPU; top_k of E experts per layer, on the CPU for the first n."""
    layers, e, k, v = cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["vocab_size"]
    per_layer = expert_bytes_by_layer(tensors, layers)
    embd = tensors.get("token_embd.weight", 0)
    non_expert = sum(tensors.values()) - sum(per_layer) - embd + embd // v
    return {"gpu": int(non_expert + sum(b * k / e for b in per_layer[n_cpu_moe:])),
            "cpu": int(sum(b * k / e for b in per_layer[:n_cpu_moe]))}


def lane_bound(tb: dict, lanes: dict | None) -> dict:
    if not lanes:
        return {"bound_tps": None}
    t = {"gpu_hbm": tb["gpu"] / (lanes["hbm_gbps"] * 1e9), "cpu_dram": tb["cpu"] / (lanes["dram_read_16t_gbps"] * 1e9)}
    return {"bytes_per_token": tb, "lane_seconds_per_token": {k: round(s, 6) for k, s in t.items()},
            "bound_tps": round(1 / max(t.values()), 1)}


# ------------------------------------------------------------------ report

def load_phases(paths: list[Path]) -> dict:
    """phase -> its JSON, from the files or folders given (the last of each phase wins)."""
    out = {}
    for p in paths:
        for f in sorted(p.glob("peer-*.json")) if p.is_dir() else [p]:
            d = json.loads(f.read_text())
            d["file"] = str(f)
            out[d["phase"]] = d
    return out


# Kiln's run (bench/h200_served.py's names) standing beside each llama.cpp placement, per quantization
KILN_RUNS = {"bf16": {"all_gpu": "resident", "budget": "tiered_24gb"},
             "q4": {"all_gpu": "resident_int4", "budget": "budget_24gb_int4"}}


def merge_kiln(paths: list[Path]) -> dict | None:
    """The runs of several h200_served JSONs (one device call rarely holds every config), each file named."""
    if not paths:
        return None
    runs, sources = {}, []
    for p in paths:
        d = json.loads(p.read_text())
        runs.update(d.get("runs", {}))
        sources.append({"file": str(p), "date": d.get("date"), "command": d.get("command"), "runs": sorted(d.get("runs", {}))})
    return {"runs": runs, "sources": sources}


def kiln_side(kiln: dict | None, run: str) -> dict | None:
    """Kiln's served figures of that run (in-process where it was not served)."""
    if not kiln:
        return None
    r = kiln.get("runs", {}).get(run, {})
    return r.get("served") or r.get("inprocess")


def report(args) -> dict:
    phases = load_phases([Path(p) for p in args.from_])
    kiln = merge_kiln([Path(k) for k in args.kiln])
    rows, targets = [], {}
    for quant in ("bf16", "q4"):
        bench = phases.get(f"bench-{quant}", {}).get("llama_bench", {})
        serve = phases.get(f"serve-{quant}", {}).get("llama_server", {})
        budget = (phases.get(f"bench-{quant}") or phases.get(f"serve-{quant}") or {}).get("budget_24gb")
        for name in dict.fromkeys([*bench, *serve]):
            b, s = bench.get(name, {}), serve.get(name, {})
            is_budget = name.endswith("_budget") or (name == "all_gpu" and budget and budget["n_cpu_moe"] == 0)
            # all on the GPU beside Kiln's resident run; the budget's placement beside Kiln's 24 GB run (with N = 0
            # all on the GPU is both)
            sides = (["all_gpu"] if name == "all_gpu" else []) + (["budget"] if is_budget else [])
            kilns = {side: kiln_side(kiln, KILN_RUNS[quant][side]) for side in sides}
            rows.append({"quant": quant, "run": name, "n_cpu_moe": b.get("n_cpu_moe", s.get("n_cpu_moe")),
                         "is_24gb_budget": bool(is_budget), "llama_bench": b, "llama_server": s,
                         "kiln_served": {side: k for side, k in kilns.items() if k} or None,
                         "kiln_runs": {side: KILN_RUNS[quant][side] for side in sides}})
    for r in rows:
        b, s = r["llama_bench"], r["llama_server"]
        for key, k in (r["kiln_served"] or {}).items():
            if b.get("decode_tps"):
                targets[f"{r['quant']}_{key}_kiln_over_llama_bench_decode"] = round(k["decode_tps"] / b["decode_tps"], 3)
            if s.get("decode_tps"):
                targets[f"{r['quant']}_{key}_kiln_over_llama_server_decode"] = round(k["decode_tps"] / s["decode_tps"], 3)
            if b.get("prefill_tps_8192"):
                targets[f"{r['quant']}_{key}_kiln_over_llama_bench_prefill_8k"] = round(k["prefill_tps"] / b["prefill_tps_8192"], 3)
            if s.get("prefill_tps"):
                targets[f"{r['quant']}_{key}_kiln_over_llama_server_prefill_8k"] = round(k["prefill_tps"] / s["prefill_tps"], 3)
    out = {"phases": {p: {k: v for k, v in d.items() if k not in ("llama_bench", "llama_server")} for p, d in phases.items()},
           "rows": rows,
           "kiln_source": kiln["sources"] if kiln else None,
           "targets": {**targets, "required": {"budget_kiln_over_llama_decode": ">= 1.5", "budget_kiln_over_llama_prefill_8k": ">= 1.0",
                                               "all_gpu_kiln_over_llama_decode": ">= 1.0"}}}

    def f(v):
        return "" if v is None else v
    log("\n| quant | run | N | llama-bench decode | pp512 | pp8192 | peak GiB | server decode | 4 streams agg | "
        "TTFT 128 (s) | server 8k prefill | bound tok/s | Kiln served decode | Kiln 8k prefill |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, s = r["llama_bench"], r["llama_server"]
        k = next(iter((r["kiln_served"] or {}).values()), {})
        log(f"| {r['quant']} | {r['run']}{' (24 GB budget)' if r['is_24gb_budget'] else ''} | {f(r['n_cpu_moe'])} | "
            f"{f(b.get('decode_tps'))} | {f(b.get('prefill_tps_512'))} | {f(b.get('prefill_tps_8192'))} | "
            f"{f(b.get('gpu_memory_peak_gib', s.get('gpu_memory_peak_gib')))} | {f(s.get('decode_tps'))} | "
            f"{f(s.get('decode_tps_4_streams_aggregate'))} | {f(s.get('ttft_s_128_prompt'))} | {f(s.get('prefill_tps'))} | "
            f"{f(b.get('bound_tps', s.get('bound_tps')))} | {f(k.get('decode_tps'))} | {f(k.get('prefill_tps'))} |")
    log("targets:", json.dumps(out["targets"]))
    return out



def earlier_llama_bench(prior: dict, name: str, want: dict) -> dict:
    """llama-bench's figures from an earlier bench.h200_gguf call's JSON `prior` on the same file, so a call short of
    device time spends it on Kiln: the slice is seeded (engine synth seed 0) and made Q4_K_M by the same
    llama-quantize, so the same `want` settings (layers, steps, prefill) are the same file and the same requests.
    ValueError where `prior` holds no llama-bench figures of those settings."""
    got = prior.get("settings") or {}
    lb = (prior.get("runs") or {}).get("llama_bench_q4_k_m") or {}
    if any(got.get(k) != v for k, v in want.items()) or not lb.get("decode_tps"):
        raise ValueError(f"holds no llama-bench run measured with {want} (it has "
                         f"{ {k: got.get(k) for k in want} }, decode {lb.get('decode_tps')})")
    # figures an earlier call took from a still earlier one keep naming the call that measured them
    return dict(lb, reused_from=lb.get("reused_from") or f"{name} ({prior.get('date')}, {prior.get('commit')})")

"""Offload on one H200 under routing you can trust (issue 32): Kiln's int4 records against llama.cpp's Q4_K_M with
`--n-cpu-moe` at the same GPU budget, under uniform, calibrated and the model's routing, in ONE device call that
also builds every weight it measures.

  python -m bench.h200_offload --work /tmp/ko --llama-bin DIR --llama-src DIR --out $OUT/h200-offload.json \
      --layers 8 --budget-s 540

What it does, in order, writing the JSON after every step (a call cut short leaves what it measured):
1. Weights: engine.synth.synthesize, what `engine synth` runs (the Qwen3-30B-A3B shape, seed 0, as the other H200 benches; --layers of its 48, 24
   in the earlier runs) twice in subprocesses — bf16 (for llama.cpp) and int4 records (Kiln's store) — and the
   bf16 checkpoint through llama.cpp's own converter (bench/gguf_from_store.py) and `llama-quantize Q4_K_M`; the
   int4 synth runs beside the conversion.
2. Budgets: each GPU budget (--budgets, GiB, the card a user has) is stated for the 24-layer checkpoint; with fewer
   layers it is scaled so the same share of the experts fits: the budget less the missing layers' non-expert
   weights and KV cache and the expert records a 24-layer run would have put on the GPU beyond this run's share.
   Kiln: GPU slots = (budget - non-expert weights - KV cache - 1.5 GiB workspace) // record (all resident where
   they fit: --experts auto); llama.cpp: the fewest leading layers N on the CPU (--n-cpu-moe N) whose other
   layers' experts fit the same room on its own GGUF's tensor sizes.
3. llama.cpp first (this process has not touched CUDA yet, so nvidia-smi's peak is llama-bench's alone):
   llama-bench -p 8192 -n STEPS -r REPS --n-cpu-moe N per budget, once: its cost does not depend on routing, and
   llama-bench runs no sampler (the peer's best case).
4. Kiln in-process (LLM.load: the entry `engine serve` uses) per budget and routing (engine.routing_trace,
   --bench-routing: uniform, calibrated, model), temperature 1 seeded: a warm-up, an untimed 8k prompt, a timed
   8k prefill, then STEPS decoded tokens of one stream. GPU peak of nvidia-smi memory.used polled every 100 ms.
   The placement plan (engine.tiers.placement) at the end of each run is kept. Order: the offloading budgets'
   calibrated and uniform runs first, then the rest, the model's routing, and last the placement's A/B (uniform
   routing with --placement cache, the tiers' behaviour before the plan) where it offloads.
5. Targets (issue 32): decode >= 1.5x llama.cpp under calibrated, >= 1.0x under uniform, 8k prefill >= 1.0x; the
   model's routing is reported, not judged.
Not done here, for the call's time: llama-server through HTTP, Kiln through `engine serve` (bench/h200_served.py
does both), lane bounds (bench/h200_served.py measures the lanes), several interleaved rounds.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import REPO, concurrent, finish, log, machine, prompt_ids, summarize, tree_commit, write_result
from bench.h200_peer import Clock, GpuMemoryPeak, Skipped, Work, ensure_q4, llama_bench, need
from engine.measure.peer import GIB, WORKSPACE, expert_bytes_by_layer, gguf_tensors
from engine.store import model_manifest

FULL_LAYERS = 24            # the budgets are a 24-layer checkpoint's, as issue 32 measured them
ROUTINGS = ("calibrated", "uniform", "model")
TARGETS = {"calibrated": 1.5, "uniform": 1.0}
PREFILL_TARGET = 1.0


# ------------------------------------------------------------------ budgets

def kv_bytes(cfg: dict, ctx: int, layers: int) -> int:
    return 2 * ctx * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * layers


def layer_non_expert_bytes(cfg: dict) -> int:
    """bf16 bytes of one layer's attention, router and norms (what Kiln keeps on the GPU per layer)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return 2 * (h * (q + 2 * kv) + q * h + cfg["num_experts"] * h + 2 * h + 2 * hd)


def kiln_budget(budget_gib: float, cfg: dict, layers: int, non_expert: int, record: int, ctx: int) -> dict:
    """Kiln's GPU slots at this budget: the 24-layer checkpoint's share of experts that fit, kept at `layers`."""
    e = cfg["num_experts"]
    per_layer = layer_non_expert_bytes(cfg)
    non_expert_full = non_expert + (FULL_LAYERS - layers) * per_layer
    room_full = budget_gib * GIB - non_expert_full - kv_bytes(cfg, ctx, FULL_LAYERS) - WORKSPACE
    slots_full = max(0, min(FULL_LAYERS * e, int(room_full // record)))
    share = slots_full / (FULL_LAYERS * e)
    slots = round(share * layers * e)
    scaled = budget_gib * GIB - (FULL_LAYERS - layers) * (per_layer + kv_bytes(cfg, ctx, 1)) - (slots_full - slots) * record
    return {"budget_gib_24_layers": budget_gib, "budget_gib_here": round(scaled / GIB, 3), "gpu_slots": slots,
            "records": layers * e, "share_of_experts_on_gpu": round(share, 4), "record_bytes": record,
            "all_resident": slots >= layers * e}


def llama_n_cpu_moe(budget_bytes_here: int, tensors: dict[str, int], cfg: dict, layers: int, ctx: int) -> dict:
    per_layer = expert_bytes_by_layer(tensors, layers)
    non_expert = sum(tensors.values()) - sum(per_layer)
    room = budget_bytes_here - non_expert - kv_bytes(cfg, ctx, layers) - WORKSPACE
    n = next(n for n in range(layers + 1) if sum(per_layer[n:]) <= room)
    return {"n_cpu_moe": n, "layers_experts_on_gpu": layers - n, "gpu_expert_bytes": sum(per_layer[n:]),
            "room_for_experts_bytes": int(room), "non_expert_bytes": non_expert,
            "share_of_experts_on_gpu": round(sum(per_layer[n:]) / max(1, sum(per_layer)), 4)}


# ------------------------------------------------------------------ weights

TINY = dict(hidden_size=256, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)


def synth_cmd(out: Path, store: Path, layers: int, quant: str, tiny: bool = False) -> list[str]:
    """engine.synth.synthesize (what `engine synth` runs) in a child, so this process has not touched CUDA when
    llama.cpp's GPU peaks are read; by function, not the CLI, so the device needs no click."""
    shape = dict(num_hidden_layers=layers, **(TINY if tiny else {}))
    call = (f"from engine.synth import synthesize; print(synthesize({str(out)!r}, {str(store)!r}, quant={quant!r}, "
            f"device={'cpu' if tiny else None!r}, **{shape!r}))")
    return [sys.executable, "-c", call]


def run_synth(cmd: list[str], log_path: Path, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} exited {r.returncode}: {log_path.read_text()[-1500:]}")
    return {"command": " ".join(["python", *cmd[1:]]), "seconds": round(time.perf_counter() - t0, 1),
            "result": log_path.read_text()[-600:]}


# ------------------------------------------------------------------ Kiln

def kiln_run(model_dir: Path, store: Path, b: dict, routing: str, args, vocab: int, placement: str = "auto",
             cpu_experts: str = "off") -> dict:
    import torch
    from engine.llm import LLM, SamplingParams
    ctx = args.prefill + args.steps + 256
    cuda = not args.tiny
    knobs = dict(device="cuda" if cuda else "cpu", max_context=ctx, max_batch=1, experts="auto",
                 gpu_slots=b["gpu_slots"] if cuda else None, ram_slots=b["records"] - (b["gpu_slots"] if cuda else 0) + 64, readers=16, bench_routing=routing,
                 bench_routing_seed=args.seed, placement=placement, cpu_experts=cpu_experts if cuda else "off")
    out: dict = {"routing": routing, "engine_config": {k: v for k, v in knobs.items()}}
    with GpuMemoryPeak() as mem:
        t0 = time.perf_counter()
        llm = LLM.load(model_dir, store, **knobs)
        out["load_s"] = round(time.perf_counter() - t0, 1)
        try:
            def stream(prompt, n, seed):
                p = SamplingParams(max_tokens=n, temperature=1.0, seed=seed, ignore_eos=True)
                return lambda o: llm.stream(prompt, p)
            concurrent([stream(prompt_ids(128, vocab, 100), 32, 1)])                 # graphs, Triton, first touches
            concurrent([stream(prompt_ids(args.prefill, vocab, 4), 2, 4)])          # the 8k shapes, untimed
            pre = summarize(concurrent([stream(prompt_ids(args.prefill, vocab, 3), 2, 3)]))
            c0 = llm.counters()
            # --decode-runs streams, each its own prompt and seed, one after another: the median is the figure
            runs = [summarize(concurrent([stream(prompt_ids(128, vocab, i + 1), args.steps, i + 1)]))
                    for i in range(args.decode_runs)]
            c1 = llm.counters()
            one = sorted(runs, key=lambda r: r["decode_tps"])[len(runs) // 2]
            out["decode_tps_runs"] = [r["decode_tps"] for r in runs]
            out.update({"decode_tps": one["decode_tps"], "steps": args.steps, "ttft_s_128_prompt": one["ttft_s"],
                        "prefill_tokens": args.prefill, "prefill_ttft_s": pre["ttft_s"],
                        "prefill_tps": round(args.prefill / pre["ttft_s"], 1)})
            out["provider"] = type(llm.model.provider).__name__
            out["zero_copy"] = (c1.get("zero_copy") is not None)
            out["decode_window"] = window(c0, c1)
            out["placement"] = c1.get("placement")
            out["lanes"] = c1.get("lanes")
            out["bench_routing"] = c1.get("bench_routing")
        finally:
            llm.close()
            del llm
            if cuda:
                torch.cuda.empty_cache()
    out.update(mem.result())
    return out


def window(a: dict, b: dict) -> dict:
    """Where the timed decode's picks were served, and what crossed PCIe, from the counters around it."""
    out = {}
    if "served" in a:
        served = {k: b["served"][k] - a["served"].get(k, 0) for k in b["served"]}
        tot = sum(served.values()) or 1
        out["served_share"] = {k: round(v / tot, 4) for k, v in served.items()}
    za, zb = a.get("zero_copy"), b.get("zero_copy")
    if za and zb:
        out["read_in_place_bytes"] = zb["read_in_place_bytes"] - za["read_in_place_bytes"]
        out["promotions"] = zb["promotions"] - za["promotions"]
    if "pcie_bytes" in a:
        out["pcie_copy_bytes"] = b["pcie_bytes"] - a["pcie_bytes"]
    return out


# ------------------------------------------------------------------ main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/kiln-offload")
    ap.add_argument("--out", required=True, help="the result JSON (on the device: under $OUT)")
    ap.add_argument("--llama-bin", required=True, help="llama-bench, llama-quantize and their libraries (CUDA)")
    ap.add_argument("--llama-src", required=True, help="llama.cpp's source tree (conversion/, gguf-py/, models/)")
    ap.add_argument("--tokenizer", required=True, help="a Qwen2 tokenizer directory (LLM.load loads one)")
    ap.add_argument("--layers", type=int, default=8, help="layers of the synthetic checkpoint (24: no scaling)")
    ap.add_argument("--budgets", default="6,12,24", help="GPU budgets in GiB, stated for 24 layers")
    ap.add_argument("--routings", default=",".join(ROUTINGS))
    ap.add_argument("--steps", type=int, default=128, help="decoded tokens of the timed stream")
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3, help="llama-bench -r (its figure is their mean)")
    ap.add_argument("--decode-runs", type=int, default=3, help="Kiln's timed decode streams a configuration, one "
                    "model load (the median is the figure; each is in decode_tps_runs)")
    ap.add_argument("--seed", type=int, default=1, help="--bench-routing-seed")
    ap.add_argument("--cpu-experts", default="off",
                    help="comma list of Kiln's --cpu-experts modes to run at the offloading budgets (off: the "
                         "engine's default; auto/on add runs keyed ROUTING_lane_MODE, after the judged ones)")
    ap.add_argument("--no-placement-ab", dest="placement_ab", action="store_false",
                    help="skip the last run: uniform routing with --placement cache at the offloading budgets")
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run: a 16-expert, 256-wide checkpoint, Kiln on "
                    "the CPU, llama.cpp's CPU binaries; every step runs, no figure means anything")
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting steps that would pass this; "
                    "the JSON holds what was measured")
    args = ap.parse_args()
    clock = Clock(args.budget_s)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    budgets = [float(b) for b in args.budgets.split(",")]
    routings = [r for r in args.routings.split(",") if r]
    res: dict = {"command": " ".join(["python", "-m", "bench.h200_offload", *sys.argv[1:]]), "commit": tree_commit(),
                 "machine": machine(), "conditions": {
                     "sampling": "temperature 1, top-p 1, seeded per request (Kiln); llama-bench has no sampler",
                     "routing": "engine.routing_trace: uniform, calibrated (hottest 11.4 % of experts take 39 % of "
                                "picks), the model's (reported, not judged)",
                     "budget": "nvidia-smi memory.used peak, polled every 100 ms, both engines",
                     "layers": args.layers, "budgets_scaled_from_24_layers": args.layers != FULL_LAYERS,
                     "rounds": f"Kiln: {args.decode_runs} decode streams a configuration (median; all in "
                               f"decode_tps_runs), one 8k prefill; llama-bench -r {args.reps} (mean, stdev)",
                     "kiln_side": "in-process (LLM.load), not through engine serve"},
                 "kiln": {}, "llama_cpp": {}, "skipped": []}

    def save():
        res["wall_s"] = clock.elapsed()
        write_result(out, res)

    # 1. weights
    w = Work(argparse.Namespace(work=str(work), llama_bin=args.llama_bin, llama_src=args.llama_src, tiny=args.tiny,
                                bench_prompts=str(args.prefill), bench_gen=args.steps, reps=args.reps,
                                no_repack=False, keep_store=False))
    model4, store4 = work / "model-int4", work / "store-int4"
    from engine.store import manifest as mf
    try:
        if not (w.store / mf.MANIFEST).exists():
            need(clock, 40, "engine synth bf16")
            res["synth_bf16"] = run_synth(synth_cmd(w.model, w.store, args.layers, "none", args.tiny), work / "synth-bf16.log",
                                          clock.left())
        int4 = None
        if not (store4 / mf.MANIFEST).exists():
            int4 = subprocess.Popen(synth_cmd(model4, store4, args.layers, "int4", args.tiny), cwd=REPO,
                                    stdout=open(work / "synth-int4.log", "w"), stderr=subprocess.STDOUT)
            t_int4 = time.perf_counter()
        save()
        gguf = ensure_q4(w, clock, res)          # bf16 GGUF by llama.cpp's converter, then llama-quantize Q4_K_M
        if int4 is not None:
            rc = int4.wait(timeout=max(1, clock.left()))
            if rc != 0:
                raise RuntimeError(f"engine synth --quant int4 exited {rc}: {(work / 'synth-int4.log').read_text()[-1500:]}")
            res["synth_int4"] = {"command": " ".join(["python", *synth_cmd(model4, store4, args.layers, "int4", args.tiny)[1:]]),
                                 "seconds_after_start": round(time.perf_counter() - t_int4, 1)}
        for f in Path(args.tokenizer).iterdir():     # LLM.load loads the model's tokenizer; ids are all we send
            shutil.copy(f, model4 / f.name)
        model_manifest.write(model4)
        save()
    except (Skipped, RuntimeError, subprocess.TimeoutExpired) as e:
        res["error"] = f"building the weights: {e}"[-3000:]
        save()
        log(res["error"])
        return 1

    cfg = json.loads((model4 / "config.json").read_text())
    vocab = cfg["vocab_size"]
    m4 = mf.load(store4)
    ctx = args.prefill + args.steps + 256
    tensors = gguf_tensors(gguf)
    non_expert = (model4 / "model.safetensors").stat().st_size
    plans = {}
    for b in budgets:
        kb = kiln_budget(b, cfg, args.layers, non_expert, m4.record_bytes, ctx)
        lb = llama_n_cpu_moe(int(kb["budget_gib_here"] * GIB), tensors, cfg, args.layers, ctx)
        plans[b] = (kb, lb)
        res.setdefault("budgets", {})[f"{b:g}"] = {"kiln": kb, "llama_cpp": lb}
    save()

    # 3. llama.cpp, once per budget (no CUDA in this process yet); budgets of the same N share one run
    by_n: dict[int, dict] = {}
    for b, (kb, lb) in plans.items():
        name = f"{b:g}gib"
        if lb["n_cpu_moe"] in by_n:
            r = dict(by_n[lb["n_cpu_moe"]], same_run_as_budget=by_n[lb["n_cpu_moe"]]["budget"])
            r["over_budget"] = (r.get("gpu_memory_peak_gib") or 0) > kb["budget_gib_here"]
            res["llama_cpp"][name] = r
            continue
        try:
            need(clock, 60, f"llama-bench at {name}")
        except Skipped as e:
            res["skipped"].append(str(e))
            continue
        r = llama_bench(w, gguf, lb["n_cpu_moe"], timeout_s=min(clock.left() - 10, 240))
        r["n_cpu_moe"], r["budget"] = lb["n_cpu_moe"], name
        by_n[lb["n_cpu_moe"]] = r
        r["over_budget"] = (r.get("gpu_memory_peak_gib") or 0) > kb["budget_gib_here"]
        res["llama_cpp"][name] = r
        save()
        log(f"llama.cpp {name} N={lb['n_cpu_moe']}: decode {r.get('decode_tps')} prefill "
            f"{r.get(f'prefill_tps_{args.prefill}')} peak {r.get('gpu_memory_peak_gib')} GiB")

    # 4. Kiln per budget and routing, the judged ones first: the offloading budgets' calibrated and uniform runs,
    # then the model's routing, then (the placement's A/B) uniform routing with --placement cache where it offloads
    offload = [b for b in budgets if not plans[b][0]["all_resident"]]
    lanes = [m for m in args.cpu_experts.split(",") if m and m != "off"]
    order = [(b, r, "auto", "off") for b in budgets for r in routings if r != "model"]
    order.sort(key=lambda x: x[0] not in offload)
    order += [(b, r, "auto", m) for m in lanes for b in offload for r in routings if r != "model"]
    order += [(b, "model", "auto", "off") for b in budgets if "model" in routings]
    order += [(b, "uniform", "cache", "off") for b in offload if args.placement_ab and "uniform" in routings]
    for b, routing, placement, cpu in order:
        name, kb = f"{b:g}gib", plans[b][0]
        key = routing if placement == "auto" else f"{routing}_placement_{placement}"
        key += "" if cpu == "off" else f"_lane_{cpu}"
        try:
            need(clock, 45, f"Kiln at {name} under {key} routing")
        except Skipped as e:
            res["skipped"].append(str(e))
            continue
        try:
            r = kiln_run(model4, store4, kb, routing, args, vocab, placement, cpu)
        except Exception as e:          # one failed run must not lose the others' figures
            r = {"error": f"{type(e).__name__}: {e}"[-2000:]}
        r["over_budget"] = (r.get("gpu_memory_peak_gib") or 0) > kb["budget_gib_here"]
        res["kiln"].setdefault(name, {})[key] = r
        save()
        log(f"Kiln {name} {key}: decode {r.get('decode_tps')} prefill {r.get('prefill_tps')} "
            f"peak {r.get('gpu_memory_peak_gib')} GiB ({clock.elapsed()} s)")

    # 5. targets and the table
    rows, verdicts = [], {}
    for b in budgets:
        name = f"{b:g}gib"
        peer = res["llama_cpp"].get(name, {})
        pd, pp = peer.get("decode_tps"), peer.get(f"prefill_tps_{args.prefill}")
        for routing in [*routings, "uniform_placement_cache", *(f"{r}_lane_{m}" for m in lanes for r in routings)]:
            k = res["kiln"].get(name, {}).get(routing)
            if k is None:
                continue
            kd, kp = k.get("decode_tps"), k.get("prefill_tps")
            dr = round(kd / pd, 3) if kd and pd else None
            pr = round(kp / pp, 3) if kp and pp else None
            rows.append({"budget": name, "routing": routing, "kiln_decode": kd, "llama_decode": pd, "decode_x": dr,
                         "kiln_prefill_8k": kp, "llama_prefill_8k": pp, "prefill_x": pr,
                         "kiln_peak_gib": k.get("gpu_memory_peak_gib"), "llama_peak_gib": peer.get("gpu_memory_peak_gib"),
                         "budget_here_gib": plans[b][0]["budget_gib_here"]})
            if routing in TARGETS and dr is not None:
                verdicts[f"{name}_{routing}_decode"] = {"x": dr, "target": TARGETS[routing],
                                                        "met": dr >= TARGETS[routing]}
            if routing in TARGETS and pr is not None:
                verdicts[f"{name}_{routing}_prefill_8k"] = {"x": pr, "target": PREFILL_TARGET,
                                                            "met": pr >= PREFILL_TARGET}
    return finish(res, rows, verdicts, save, out, clock.elapsed())


if __name__ == "__main__":
    sys.exit(main())

"""GLM-5.3-Flash on Kiln's tiers at the seed's budget, beside llama.cpp on the same weights (issue 28), in ONE device
call that also builds every weight it measures.

  python -m bench.glm5_next_offload --work /tmp/g5 --shm /dev/shm/g5 --llama-bin B --llama-src B/src \
      --moe-layers 2 --budget-s 540 --out $OUT/glm5-next-offload.json
  python -m bench.glm5_next_offload --tiny --work /tmp/g5t --llama-bin .kiln/cache/llama.cpp/bin \
      --llama-src .kiln/cache/llama.cpp --out /tmp/g5t/out.json          # the CPU dry run: every step, no figure

In order, the JSON written after every step (a call cut short keeps what it measured):
1. Slice: `engine synth --shape glm-5.3-flash` (engine.synth.synthesize in a child, int4 records, seed 0): the 3 dense
   layers and --moe-layers MoE layers in the full model's schedule (KDA, with DSA every 4th). engine.measure.glm5_slice
   says how many MoE layers the disk and /dev/shm hold (`slice` in the JSON); --moe-layers is what one call's time
   builds and measures (the README's arithmetic). A stand-in byte-level tokenizer, padded to the vocabulary, serves
   both engines (ids are all either reads).
2. llama.cpp's weights: scripts/glm5_next_gguf.py (llama.cpp's own convert_hf_to_gguf.py through the flat config)
   reads the same int4 experts from Kiln's store, dequantized, into a bf16 GGUF on --shm; `llama-quantize Q4_K_M`;
   the Q4_K_M moves to --work and the bf16 goes.
3. Placements: llama.cpp's --n-cpu-moe N whose GPU share of its expert bytes is nearest the seed's 11.4 %
   (whole layers: with few MoE layers that may be 0); Kiln twice: `like_for_like` (the GPU slots of llama.cpp's
   share, every other record in the RAM tier) and `three_tier` (the seed's tiers scaled: GPU slots 11.4 % of the
   records, RAM tier 39.9 %, the rest read from the store with O_DIRECT), plus `resident` (every record on the GPU:
   the GPU lane's step, the bound's t_gpu and the projection's fixed cost). --cpu-experts sets Kiln's CPU lane.
4. llama-bench -p 8192,32768 -n STEPS --n-cpu-moe N (no sampler: the peer's best case), before this process
   touches CUDA, so nvidia-smi's peak is its own.
   --llama-json FILE takes steps 2 and 4 from an earlier call's JSON on the same (seeded) slice instead, so a call
   short of device time spends it all on Kiln.
5. Kiln in-process (LLM.load, the entry `engine serve` uses) per placement and routing (--bench-routing uniform,
   calibrated: Zipf s 0.650 for 288 experts, the model's: reported, not judged), temperature 1 seeded: warm-up,
   an untimed 8k prompt, timed 8k and 32k prefills, an untimed stream of --warm-steps tokens (the tiers settle after
   the prefills turned them over), STEPS tokens of one stream and of 4, the lanes' bytes and busy
   seconds over the one-stream window; `engine serve` through HTTP for three_tier under calibrated routing (its
   /metrics' lane counters) right after the calibrated runs, then uniform, then the model's, where time is left.
   Prefill chunks of --chunk-size tokens: every chunk of an offloaded prefill moves the experts it picks, so the
   chunk sets the prefill's bytes.
6. Each decode figure beside its bound t >= max(t_gpu, B_pcie/BW_pcie, B_disk/BW_disk, B_cpu/BW_cpu): bytes per
   token from the window's lane counters, bandwidths measured in this call (bench.harness.measure_lanes on the
   int4 store, the store's rate the faster of a cold pass and a re-read; DRAM read on 16 threads), t_gpu the
   resident step of the same call.
7. Targets (issue 28): like-for-like decode >= 1.5x llama.cpp, 8k prefill >= 1.5x, three-tier decode >= 0.6 of its
   lane bound (calibrated routing). bench.projection_3090 --glm5 projects this file to the seed's box.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import (REPO, STREAMS, completions_client, concurrent, dram_read_gbps, finish, free_port, log,
                           machine, measure_lanes, metrics, prompt_ids, stop, summarize, tree_commit, wait_ready,
                           write_result)
from bench.h200_offload import run_synth
from bench.h200_peer import Clock, GpuMemoryPeak, Skipped, Work, llama_bench, llama_env, need
from engine.measure import glm5_slice
from engine.synth import stand_in_tokenizer
from engine.measure.peer import expert_bytes_by_layer, gguf_tensors

ROUTINGS = ("calibrated", "uniform", "model")
PLACEMENTS = ("resident", "like_for_like", "three_tier")
TARGETS = {"like_for_like_decode_x": 1.5, "like_for_like_prefill_8k_x": 1.5, "three_tier_fraction_of_bound": 0.6}
SCRIPT = REPO / "scripts" / "glm5_next_gguf.py"
# The CPU dry run's slice: GLM-5.3-Flash's layer kinds and schedule at toy widths (rows of 256 so that Q4_K_M writes
# K-quant blocks), 3 dense + 2 MoE layers of 16 experts.
TINY_SHAPE = dict(hidden_size=256, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                  intermediate_size=512, vocab_size=4096, num_attention_heads=4, num_key_value_heads=4,
                  kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=64, v_head_dim=64, index_head_dim=32,
                  index_n_heads=4, index_topk=64, index_kpool=4,
                  linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4,
                                      "gate_lower_bound": -5.0, "safe_gate": True})


# ------------------------------------------------------------------ weights

def slice_config(moe_layers: int, tiny: bool) -> dict:
    from engine.synth import synth_config
    return synth_config("glm5_next", num_hidden_layers=glm5_slice.DENSE + moe_layers, **(TINY_SHAPE if tiny else {}))


def synth_cmd(out: Path, store: Path, moe_layers: int, tiny: bool) -> list[str]:
    """engine synth --shape glm-5.3-flash --quant int4 (by function in a child: no CUDA in this process yet)."""
    shape = dict(num_hidden_layers=glm5_slice.DENSE + moe_layers, **(TINY_SHAPE if tiny else {}))
    call = (f"from engine.synth import synthesize; print(synthesize({str(out)!r}, {str(store)!r}, quant='int4', "
            f"arch='glm5_next', device={'cpu' if tiny else None!r}, **{shape!r}))")
    return [sys.executable, "-c", call]


def build_weights(args, work: Path, shm: Path, clock: Clock, res: dict, save) -> tuple[Path, Path, Path | None]:
    """Kiln's model + int4 store in --work, llama.cpp's Q4_K_M beside them (each reused where already there; no
    Q4_K_M where --llama-json brings the peer's figures)."""
    from engine.store import manifest as mf
    from engine.store import model_manifest
    model, store, q4 = work / "model-int4", work / "store-int4", work / "glm5-next-Q4_K_M.gguf"
    if not (store / mf.MANIFEST).exists():
        need(clock, 20 if args.tiny else 60, "engine synth (int4)")
        cmd = synth_cmd(model, store, args.moe_layers, args.tiny)
        res["synth_int4"] = run_synth(cmd, work / "synth-int4.log", clock.left())
        stand_in_tokenizer(model, json.loads((model / "config.json").read_text())["vocab_size"])   # ids only
        model_manifest.write(model)
        save()
    if args.llama_json:
        return model, store, None
    if not q4.exists():
        need(clock, 40 if args.tiny else 200, "conversion (convert_hf_to_gguf.py) and llama-quantize Q4_K_M")
        t0 = time.perf_counter()
        # the bf16 GGUF where it fits: /dev/shm (RAM) first, else the disk beside the rest
        fits = res["slice"]["fits_by"]
        out = (shm if fits["shm"] >= args.moe_layers or shm == work else work) / "gguf"
        r = subprocess.run([sys.executable, str(SCRIPT), str(model), str(out), "--llama-cpp", str(args.llama_src),
                            "--store", str(store), "--base", "BF16", "--types", "BF16,Q4_K_M",
                            "--llama-quantize", str(Path(args.llama_bin) / "llama-quantize")],
                           capture_output=True, text=True, timeout=max(1, clock.left()), cwd=REPO,
                           env=llama_env(Path(args.llama_bin)))
        if r.returncode != 0:
            raise RuntimeError(f"glm5_next_gguf exited {r.returncode}: {r.stderr[-2000:]}")
        files = json.loads(r.stdout)
        bf16_bytes = Path(files["BF16"]).stat().st_size
        shutil.move(files["Q4_K_M"], q4)
        shutil.rmtree(out)                         # the bf16 GGUF and the flat copy: /dev/shm is RAM
        res["gguf"] = {"command": " ".join(["python", "scripts/glm5_next_gguf.py", *r.args[2:]]),
                       "seconds": round(time.perf_counter() - t0, 1), "bf16_bytes": bf16_bytes,
                       "q4_k_m_bytes": q4.stat().st_size, "log_tail": r.stderr[-600:]}
        save()
    return model, store, q4


# ------------------------------------------------------------------ placements

def peer_share(cfg: dict, tensors: dict[str, int]) -> dict:
    """llama.cpp's --n-cpu-moe whose GPU share of the Q4_K_M's expert bytes is nearest the seed's."""
    per_layer = expert_bytes_by_layer(tensors, cfg["num_hidden_layers"])
    return glm5_slice.n_cpu_moe_for_share(per_layer, glm5_slice.SEED_GPU_SHARE)


def knobs(p: dict, placement: str, routing: str, args) -> dict:
    cuda = not args.tiny
    k = dict(device="cuda" if cuda else "cpu", max_context=max(args.prefills) + args.steps + 256, max_batch=STREAMS,
             experts="resident" if placement == "resident" and cuda else "tiered", readers=16, bench_routing=routing,
             bench_routing_seed=args.seed, chunk_size=args.chunk_size, cpu_experts=args.cpu_experts)
    if placement == "resident" and not cuda:
        k.update(ram_slots=p["records"])            # no GPU: every record in the RAM tier over the store
    elif placement != "resident":
        # on the CPU there is no GPU tier: its share is read from the store (the dry run's figures mean nothing)
        k.update(gpu_slots=p["gpu_slots"] if cuda else None, ram_slots=max(1, p["ram_slots"]))
    return k


# ------------------------------------------------------------------ Kiln

def lane_window(a: dict, b: dict, tokens: int) -> dict:
    """Bytes and busy seconds per token of each lane over a window, from two counters() (in-process) or two
    /metrics reads (served)."""
    n = max(1, tokens - 1)
    out = {}
    for lane in ("gpu", "pcie", "disk", "cpu"):
        if "lanes" in b:
            da, db = a["lanes"][lane], b["lanes"][lane]
            by, busy = db["bytes"] - da["bytes"], db["seconds"] - da["seconds"]
        else:
            key = f'{{lane="{lane}"}}'
            by = b.get(f"kiln_lane_bytes_total{key}", 0) - a.get(f"kiln_lane_bytes_total{key}", 0)
            busy = b.get(f"kiln_lane_busy_seconds_total{key}", 0) - a.get(f"kiln_lane_busy_seconds_total{key}", 0)
        out[lane] = {"bytes_per_token": int(by / n), "busy_seconds_per_token": round(busy / n, 6)}
    if "served" in b:
        served = {k: b["served"][k] - a["served"].get(k, 0) for k in b["served"]}
    else:
        key = 'kiln_expert_served_total{{tier="{}"}}'
        served = {t: b.get(key.format(t), 0) - a.get(key.format(t), 0) for t in ("gpu", "ram", "store")}
    tot = sum(served.values()) or 1
    out["served_share"] = {k: round(v / tot, 4) for k, v in served.items()}
    return out


def timed_runs(make, vocab: int, args, counters) -> dict:
    """The figures of one configuration, the same requests in-process or served: make(prompt, n, seed) -> stream."""
    concurrent([make(prompt_ids(128, vocab, 100 + i), min(16, args.steps), 100 + i) for i in range(STREAMS)])  # graphs
    concurrent([make(prompt_ids(args.prefills[0], vocab, 4), 2, 4)])                         # the long shapes
    out: dict = {}
    for n in args.prefills:
        a = counters()
        pre = summarize(concurrent([make(prompt_ids(n, vocab, 3), 2, 3)]))
        out[f"prefill_tps_{n}"] = round(n / pre["ttft_s"], 1)
        out[f"prefill_lanes_{n}"] = lane_window(a, counters(), 2)      # the whole prompt's bytes (and 2 tokens')
    # the tiers settle before the decode window: every prefill chunk picks every expert and turns both tiers over,
    # so a window right after them measures a cold cache (6/18/76 % on 2026-12-05, not a steady state)
    if args.warm_steps:
        concurrent([make(prompt_ids(128, vocab, 2), args.warm_steps, 2)])
    c0 = counters()
    one = summarize(concurrent([make(prompt_ids(128, vocab, 1), args.steps, 1)]))
    c1 = counters()
    four = summarize(concurrent([make(prompt_ids(128, vocab, 10 + i), args.steps, 10 + i) for i in range(STREAMS)]))
    out.update({"decode_tps": one["decode_tps"], "steps": args.steps, "ttft_s_128_prompt": one["ttft_s"],
                "decode_tps_4_streams_aggregate": four["aggregate_tps"],
                "lanes_per_token": lane_window(c0, c1, one["tokens_per_stream"][0])})
    return out


def kiln_inprocess(model: Path, store: Path, kw: dict, vocab: int, args) -> dict:
    from engine.llm import LLM, SamplingParams
    out: dict = {"engine_config": kw, "side": "in-process (LLM.load)"}
    with GpuMemoryPeak() as mem:
        t0 = time.perf_counter()
        llm = LLM.load(model, store, **kw)
        out["load_s"] = round(time.perf_counter() - t0, 1)
        try:
            def make(prompt, n, seed):
                p = SamplingParams(max_tokens=n, temperature=1.0, seed=seed, ignore_eos=True)
                return lambda o: llm.stream(prompt, p)
            out.update(timed_runs(make, vocab, args, llm.counters))
            c = llm.counters()
            out.update(provider=type(llm.model.provider).__name__, placement=c.get("placement"),
                       bench_routing=c.get("bench_routing"), tiers=c.get("tiers"), cpu_experts=c.get("cpu_experts"))
        finally:
            llm.close()
            del llm
            if not args.tiny:
                import torch
                torch.cuda.empty_cache()
    out.update(mem.result())
    return out


def kiln_served(model: Path, store: Path, kw: dict, vocab: int, args, log_path: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    flags = {"device": kw["device"], "ctx": kw["max_context"], "max-batch": kw["max_batch"], "experts": kw["experts"],
             "readers": kw["readers"], "bench-routing": kw["bench_routing"], "bench-routing-seed": kw["bench_routing_seed"],
             "chunk-size": kw["chunk_size"], "cpu-experts": kw["cpu_experts"], "gpu-slots": kw.get("gpu_slots"),
             "ram-slots": kw.get("ram_slots")}
    cmd = [sys.executable, "-m", "engine", "serve", "--model", str(model), "--store", str(store), "--port", str(port),
           "--served-name", "glm5", "--log-level", "warning",
           *[a for k, v in flags.items() if v is not None for a in (f"--{k}", str(v))]]
    out: dict = {"command": " ".join(["python", *cmd[1:]]), "side": "served (engine serve, HTTP)"}
    with open(log_path, "w") as logf, GpuMemoryPeak() as mem:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out["load_s"] = round(wait_ready(proc, base, log_path, "engine serve"), 1)
            client = completions_client(base, "glm5", [])
            out.update(timed_runs(lambda prompt, n, seed: client(prompt, n, 1.0, seed), vocab, args,
                                  lambda: metrics(base)))
        finally:
            stop(proc)
    out.update(mem.result())
    return out


# ------------------------------------------------------------------ bounds and verdicts

def disk_gbps(lanes: dict) -> float:
    """The store lane's rate a bound divides by: the faster of a cold pass of random records and a re-read of the
    same ones (the readers re-read evicted records; the 2026-12-05 run's readers beat the cold rate, 2.4 against
    1.35 GB/s, which made its bound no bound)."""
    return max(lanes["disk_odirect_random_16t_gbps"], lanes.get("disk_odirect_reread_16t_gbps", 0.0))


def lane_bound(window: dict, lanes: dict, t_gpu: float, tokens: int, tps: float | None) -> dict:
    """t >= max(t_gpu, B_pcie/BW_pcie, B_disk/BW_disk, B_cpu/BW_cpu) for `tokens` tokens, each lane's bytes over the
    rate measured in this call; the bound in tok/s beside the measured `tps`."""
    b = {k: v["bytes_per_token"] for k, v in window.items() if k in ("gpu", "pcie", "disk", "cpu")}
    t = {"gpu": max(t_gpu, b["gpu"] / (lanes["hbm_gbps"] * 1e9)), "pcie": b["pcie"] / (lanes["pcie_h2d_pinned_gbps"] * 1e9),
         "disk": b["disk"] / (disk_gbps(lanes) * 1e9),
         "cpu": b["cpu"] / (lanes["dram_read_16t_gbps"] * 1e9)}
    bound = tokens / max(t.values()) if max(t.values()) > 0 else None
    return {"lane_seconds": {k: round(v, 6) for k, v in t.items()}, "binding_lane": max(t, key=t.get),
            "bound_tps": round(bound, 1) if bound else None,
            "fraction_of_bound": round(tps / bound, 3) if bound and tps else None}


def attach_bound(run: dict, lanes: dict | None, resident: dict | None, prefills: list[int]) -> None:
    """Decode (per token) and each prefill (the whole prompt) beside its lane bound; t_gpu the resident run's time
    for the same work in this call (its decode step, its prefill of the same length)."""
    if not lanes or "lanes_per_token" not in run:
        run["bound"] = None
        return
    step = 1 / resident["decode_tps"] if resident and resident.get("decode_tps") else 0.0
    run["bound"] = lane_bound(run["lanes_per_token"], lanes, step, 1, run.get("decode_tps"))
    for n in prefills:
        t_gpu = n / resident[f"prefill_tps_{n}"] if resident and resident.get(f"prefill_tps_{n}") else 0.0
        run[f"prefill_bound_{n}"] = lane_bound(run[f"prefill_lanes_{n}"], lanes, t_gpu, n, run.get(f"prefill_tps_{n}"))


def verdicts(res: dict, args) -> tuple[list[dict], dict]:
    rows, judged = [], {}
    peer = res["llama_cpp"].get("llama_bench", {})
    p8 = f"prefill_tps_{args.prefills[0]}"
    for placement, by_routing in res["kiln"].items():
        for routing, r in by_routing.items():
            if "error" in r or "skipped" in r:
                continue
            row = {"placement": placement, "routing": routing, "kiln_decode": r.get("decode_tps"),
                   "llama_decode": peer.get("decode_tps"), "kiln_4_streams": r.get("decode_tps_4_streams_aggregate")}
            for n in args.prefills:
                row[f"kiln_prefill_{n}"] = r.get(f"prefill_tps_{n}")
                row[f"llama_prefill_{n}"] = peer.get(f"prefill_tps_{n}")
            row["decode_x"] = round(r["decode_tps"] / peer["decode_tps"], 3) if peer.get("decode_tps") else None
            row["prefill_8k_x"] = (round(r[p8] / peer[p8], 3) if peer.get(p8) and r.get(p8) else None)
            row["bound_tps"] = (r.get("bound") or {}).get("bound_tps")
            row["fraction_of_bound"] = (r.get("bound") or {}).get("fraction_of_bound")
            row["prefill_8k_bound_tps"] = (r.get(f"prefill_bound_{args.prefills[0]}") or {}).get("bound_tps")
            row["gpu_peak_gib"] = r.get("gpu_memory_peak_gib")
            rows.append(row)
            if routing != "calibrated" or placement.endswith("_served"):
                continue
            if placement == "like_for_like":
                for key, x in (("like_for_like_decode_x", row["decode_x"]), ("like_for_like_prefill_8k_x", row["prefill_8k_x"])):
                    if x is not None:
                        judged[key] = {"x": x, "target": TARGETS[key], "met": x >= TARGETS[key]}
            if placement == "three_tier" and row["fraction_of_bound"] is not None:
                f = row["fraction_of_bound"]
                judged["three_tier_fraction_of_bound"] = {"x": f, "target": TARGETS["three_tier_fraction_of_bound"],
                                                          "met": f >= TARGETS["three_tier_fraction_of_bound"]}
    return rows, judged


# ------------------------------------------------------------------ main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/kiln-glm5", help="Kiln's model and store, llama.cpp's Q4_K_M (disk)")
    ap.add_argument("--shm", default=None, help="where the bf16 GGUF is made (default --work; /dev/shm on the H200)")
    ap.add_argument("--out", required=True, help="the result JSON (on the device: under $OUT)")
    ap.add_argument("--llama-bin", required=True, help="llama-bench, llama-quantize and their libraries")
    ap.add_argument("--llama-src", required=True, help="llama.cpp's convert_hf_to_gguf.py with conversion/ and gguf-py/")
    ap.add_argument("--moe-layers", type=int, default=2, help="MoE layers after the 3 dense ones (42 in the model)")
    ap.add_argument("--routings", default=",".join(ROUTINGS))
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--steps", type=int, default=None, help="decoded tokens of each timed stream (64; --tiny 8)")
    ap.add_argument("--warm-steps", type=int, default=None, help="tokens of one untimed stream right before the "
                    "decode window, so the tiers settle after the prefills (256; --tiny 4; 0: none)")
    ap.add_argument("--prefills", default=None, help="timed prompt lengths, the first the 8k target's "
                    "(8192,32768; --tiny 128,256)")
    ap.add_argument("--chunk-size", type=int, default=None, help="prefill tokens a scheduler turn (engine --chunk-size; "
                    "8192, --tiny 128)")
    ap.add_argument("--cpu-experts", default="auto", choices=("off", "auto", "on"), help="Kiln's CPU expert lane")
    ap.add_argument("--no-served", dest="served", action="store_false", help="skip engine serve through HTTP")
    ap.add_argument("--seed", type=int, default=1, help="--bench-routing-seed")
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run: a toy-width slice, Kiln on the CPU, "
                    "llama.cpp's CPU binaries; every step runs, no figure means anything")
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting steps that would pass this")
    ap.add_argument("--llama-json", type=Path, default=None, help="llama.cpp's figures and placement from an earlier "
                    "call's JSON on the same slice: no conversion, no llama-bench, the call's time all Kiln's")
    args = ap.parse_args()
    tiny_or = lambda v, full, tiny: v if v is not None else (tiny if args.tiny else full)     # noqa: E731
    args.steps, args.chunk_size = tiny_or(args.steps, 64, 8), tiny_or(args.chunk_size, 8192, 128)
    args.warm_steps = tiny_or(args.warm_steps, 256, 4)
    args.prefills = [int(x) for x in tiny_or(args.prefills, "8192,32768", "128,256").split(",") if x]
    if args.moe_layers < 1 or args.moe_layers > glm5_slice.FULL_MOE_LAYERS:
        print(f"glm5_next_offload: --moe-layers {args.moe_layers} is not within 1..{glm5_slice.FULL_MOE_LAYERS}",
              file=sys.stderr)
        return 2
    bad = [r for r in args.routings.split(",") if r not in ROUTINGS] + \
          [p for p in args.placements.split(",") if p not in PLACEMENTS]
    if bad:
        print(f"glm5_next_offload: {bad[0]!r} is not one of the routings {ROUTINGS} or placements {PLACEMENTS}",
              file=sys.stderr)
        return 2
    routings, wanted = args.routings.split(","), args.placements.split(",")
    clock = Clock(args.budget_s)
    work, out = Path(args.work), Path(args.out)
    shm = Path(args.shm) if args.shm else work
    for d in (work, shm):
        d.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": " ".join(["python", "-m", "bench.glm5_next_offload", *sys.argv[1:]]), "commit": tree_commit(),
                 "machine": machine(), "conditions": {
                     "sampling": "temperature 1, top-p 1, seeded per request (Kiln); llama-bench has no sampler",
                     "routing": "engine.routing_trace: calibrated (Zipf s fitted so the hottest 11.4 % of experts take "
                                "39 % of picks: 0.650 for 288 experts at top-8), uniform, the model's (not judged)",
                     "model": f"GLM-5.3-Flash-shaped slice: 3 dense + {args.moe_layers} MoE layers"
                              + (" (toy widths: --tiny)" if args.tiny else ""),
                     "chunk_size": args.chunk_size, "cpu_experts": args.cpu_experts,
                     "budget": "nvidia-smi memory.used peak, polled every 100 ms, both engines",
                     "rounds": "one timed run per configuration (the call's time): no spread"},
                 "kiln": {}, "llama_cpp": {}, "skipped": []}

    def save():
        res["wall_s"] = clock.elapsed()
        write_result(out, res)

    # 1-2. the slice's size against this machine, then the weights
    from engine.experts.layout import ExpertLayout
    import torch
    cfg0 = slice_config(args.moe_layers, args.tiny)
    rec = ExpertLayout(cfg0["hidden_size"], cfg0["moe_intermediate_size"], torch.uint8, "rows", "int4").record_bytes
    shm_free = shutil.disk_usage(shm).free
    res["slice"] = glm5_slice.disk_plan(lambda n: slice_config(n, args.tiny), rec, shutil.disk_usage(work).free,
                                        shm_free, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    res["slice"]["bf16_beside_the_rest"] = shm == work      # one filesystem: the plan's two bounds overlap
    res["slice"]["moe_layers_run"] = args.moe_layers
    save()
    try:
        model, store, q4 = build_weights(args, work, shm, clock, res, save)
    except (Skipped, RuntimeError, subprocess.TimeoutExpired) as e:
        res["error"] = f"building the weights: {e}"[-3000:]
        save()
        log(res["error"])
        return 1
    from engine.store import manifest as mf
    cfg = json.loads((model / "config.json").read_text())
    m4 = mf.load(store)
    records = len(m4.moe_layers) * m4.experts_per_layer
    if args.llama_json:
        try:
            res["llama_cpp"], peer = glm5_slice.earlier_peer(json.loads(args.llama_json.read_text()),
                                                             args.llama_json.name, cfg["num_hidden_layers"])
        except (OSError, ValueError) as e:
            print(f"glm5_next_offload: --llama-json {args.llama_json}: {e}", file=sys.stderr)
            return 2
    else:
        peer = peer_share(cfg, gguf_tensors(q4))
    plan = glm5_slice.placements(records, peer)
    res["placements"] = plan
    res["checkpoint"] = {"layers": cfg["num_hidden_layers"], "moe_layers": len(m4.moe_layers),
                         "experts": m4.experts_per_layer, "top_k": cfg["num_experts_per_tok"],
                         "record_bytes": m4.record_bytes, "store_bytes": records * m4.record_bytes,
                         "vocab_bytes": cfg["vocab_size"] * cfg["hidden_size"] * 2,     # the embedding table, bf16
                         "non_expert_bytes_per_token": glm5_slice.non_expert_bytes_per_token(cfg),
                         "full_model_non_expert_bytes_per_token": glm5_slice.non_expert_bytes_per_token(
                             slice_config(glm5_slice.FULL_MOE_LAYERS, args.tiny))}
    save()

    # 4. llama.cpp first: no CUDA in this process yet
    w = Work(argparse.Namespace(work=str(work), llama_bin=args.llama_bin, llama_src=args.llama_src, tiny=args.tiny,
                                bench_prompts=",".join(map(str, args.prefills)), bench_gen=args.steps, reps=1,
                                no_repack=False, keep_store=True))
    try:
        if args.llama_json:
            raise Skipped(f"llama-bench: its figures come from {args.llama_json.name} (--llama-json)")
        need(clock, 30 if args.tiny else 90, "llama-bench")
        r = llama_bench(w, q4, plan["llama_cpp"]["n_cpu_moe"], timeout_s=min(clock.left() - 10, 300))
        r["n_cpu_moe"] = plan["llama_cpp"]["n_cpu_moe"]
        res["llama_cpp"]["llama_bench"] = r
        log(f"llama.cpp N={r['n_cpu_moe']}: decode {r.get('decode_tps')} prefill "
            f"{[r.get(f'prefill_tps_{n}') for n in args.prefills]} peak {r.get('gpu_memory_peak_gib')} GiB")
    except Skipped as e:
        res["skipped"].append(str(e))
    save()

    # the lanes the bound divides by, measured now on this machine (CUDA only)
    lanes = None
    if not args.tiny:
        lanes = measure_lanes(store / mf.DATA, m4.record_bytes, records)
        lanes["dram_read_16t_gbps"] = dram_read_gbps(16)
        torch.cuda.empty_cache()
    res["lanes"] = lanes
    save()

    # 5. Kiln: the resident step first (every bound's t_gpu), the judged calibrated runs, served, uniform, the model's
    order = [(p, "calibrated") for p in ("resident", "like_for_like", "three_tier") if p in wanted and "calibrated" in routings]
    if args.served and "three_tier" in wanted and "calibrated" in routings:
        order.append(("three_tier_served", "calibrated"))
    order += [(p, "uniform") for p in ("like_for_like", "three_tier") if p in wanted and "uniform" in routings]
    order += [(p, "model") for p in ("like_for_like", "three_tier") if p in wanted and "model" in routings]
    vocab = cfg["vocab_size"]
    for placement, routing in order:
        base = placement.removesuffix("_served")
        kw = knobs(plan[base], base, routing, args)
        try:
            need(clock, 45 if args.tiny else 90, f"Kiln {placement} under {routing} routing")
        except Skipped as e:
            res["skipped"].append(str(e))
            continue
        try:
            if placement.endswith("_served"):
                r = kiln_served(model, store, kw, vocab, args, work / f"serve-{routing}.log")
            else:
                r = kiln_inprocess(model, store, kw, vocab, args)
        except Exception as e:          # one failed run must not lose the others' figures
            r = {"error": f"{type(e).__name__}: {e}"[-2000:]}
        resident = res["kiln"].get("resident", {}).get("calibrated")
        if "error" not in r:
            attach_bound(r, lanes, resident if base != "resident" else None, args.prefills)
        res["kiln"].setdefault(placement, {})[routing] = r
        save()
        log(f"Kiln {placement} {routing}: decode {r.get('decode_tps')} prefill "
            f"{[r.get(f'prefill_tps_{n}') for n in args.prefills]} bound {(r.get('bound') or {}).get('bound_tps')} "
            f"({clock.elapsed()} s){' ' + r['error'][:300] if 'error' in r else ''}")

    # 6-7. the table and the targets
    rows, judged = verdicts(res, args)
    return finish(res, rows, judged, save, out, clock.elapsed())


if __name__ == "__main__":
    sys.exit(main())

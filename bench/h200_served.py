"""Kiln's served engine on one H200, through HTTP, beside the same engine in-process and llama.cpp on the
same weights, in one run (issue 13). bench/h200_peer.py measures the peer in phases that each fit a device call,
with this file's HTTP client, and through llama-server too.

  python -m bench.h200_served --work /tmp/kb --tokenizer DIR --llama DIR --out bench/results/<date>-h200-served.json

1. Lanes of this machine (HBM, pinned PCIe, O_DIRECT disk, DRAM): the harness's measure_lanes, plus
   a 16-thread DRAM read (the CPU lane llama.cpp's --n-cpu-moe uses).
2. The synthetic 24-layer Qwen3-30B-A3B-shaped checkpoint (engine/synth.py, bf16, experts in a rows-order
   store) with Qwen2's tokenizer (151,936 tokens, from llama.cpp's models/ggml-vocab-qwen2.gguf) so that
   `engine serve` can load it.
3. For each placement — resident (every expert on the GPU) and tiered under a 24 GB card's budget (GPU slots
   = 24 GiB - non-expert weights - KV cache - workspace; a 16 GiB page-locked RAM tier; the rest from the
   store) — the engine built by LLM.load (the entry `engine serve` uses), in-process: decode tok/s at 1 and
   4 streams, TTFT of a 128-token prompt, 8k prefill; then a real `engine serve --device cuda` subprocess
   measured through HTTP (/v1/completions, streamed, usage included) on the same requests, with /metrics
   showing the provider and the decode-graph replays.
   Decoding: greedy for resident (routing does not change its cost), sampled at temperature 1 (seeded) for
   tiered, so that the routing follows the tokens instead of a greedy loop's repeats (a cache's best case).
4. llama.cpp (prebuilt for sm_90, --llama DIR): the same weights converted to GGUF bf16 with llama.cpp's own
   converter class (experts read from the store, the vocabulary from ggml-vocab-qwen2.gguf), llama-bench
   `-p 8192 -n 128 -r 2` all on the GPU and, with --llama-n-cpu-moe, with `--n-cpu-moe 7` (17 of 24 layers'
   experts on the GPU: the 24 GB budget). bench/h200_peer.py runs the fuller peer set in phases.
   --configs picks the placements: the fused-kernel A/B (resident_torch_ops) and int4 records (engine synth
   --quant int4: resident_int4, budget_24gb_int4) beside resident and tiered_24gb.
5. Each figure beside its lane bound (ANCHORS.md): t >= max(t_non_expert + B_gpu/BW_hbm, B_pcie/BW_pcie,
   B_disk/BW_disk, B_cpu/BW_dram), bytes per token from this run's counters.
Prints a table last; writes everything to --out after every part.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import torch

from bench.harness import (REPO, completions_client, dram_read_gbps, free_port, gguf_convert, llama_bench_figures,
                           log, measure, measure_lanes, metrics, stop, wait_ready, write_result)
from engine.measure.peer import CARD_BYTES, RAM_TIER, STREAMS, WORKSPACE
from engine.store import manifest as mf
from engine.store import model_manifest
from engine.synth import QWEN3_30B_A3B, synthesize

DEV = torch.device("cuda")


# ------------------------------------------------------------------ what one token must move

def token_bytes(cfg: dict, record_bytes: int, non_expert_file_bytes: int) -> dict:
    """HBM bytes one decode token reads at least: every non-expert weight but the embedding table (one row of
    it), and top_k experts per MoE layer; FLOPs of an 8k prefill token (2 per weight touched)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    non_expert = non_expert_file_bytes - v * h * 2 + h * 2
    experts = cfg["num_hidden_layers"] * cfg["num_experts_per_tok"] * record_bytes
    active_params = (non_expert - h * 2) / 2 + cfg["num_hidden_layers"] * cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
    return {"non_expert_bytes_per_token": int(non_expert), "expert_bytes_per_token": int(experts),
            "active_params": int(active_params)}


def resident_bound(tb: dict, lanes: dict) -> dict:
    t = (tb["non_expert_bytes_per_token"] + tb["expert_bytes_per_token"]) / (lanes["hbm_gbps"] * 1e9)
    return {"bound_tps": round(1 / t, 1), "lane_seconds_per_token": {"gpu_hbm": round(t, 6)}}


# ------------------------------------------------------------------ in-process (LLM, the entry the server uses)

def inprocess(model_dir, store, kw: dict, vocab, steps, prefill, sampled, uniform: bool = False) -> tuple[dict, dict]:
    from engine.llm import LLM, SamplingParams
    t0 = time.perf_counter()
    if uniform:          # the routers' choice drawn uniformly (engine.routing_trace, --bench-routing; prefill too)
        kw = {**kw, "bench_routing": "uniform"}
    llm = LLM.load(model_dir, store, device="cuda", max_context=prefill + 512, max_batch=STREAMS, **kw)
    load_s = time.perf_counter() - t0

    def make(prompt, n, temp, seed):
        p = SamplingParams(max_tokens=n, temperature=temp, seed=seed, ignore_eos=True)
        return lambda out: llm.stream(prompt, p)

    try:
        res = measure(make, vocab, steps, prefill, sampled, llm.counters)
        res["load_s"] = round(load_s, 1)
        if uniform:
            res["routing"] = "uniform top-k per token, prefill and decode (--bench-routing uniform, labelled)"
        g = llm.model.graphs
        res["provider"] = type(llm.model.provider).__name__
        res["zero_copy"] = getattr(llm.model.provider, "zero_copy", None) is not None
        res["cuda_graphs"] = {"captured": g.captures, "replays": g.replays, "pieces_per_step": g.pieces_per_step} if g else None
        c = llm.counters()
    finally:
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return res, c


# ------------------------------------------------------------------ served (engine serve, HTTP)

@contextmanager
def kiln_server(model, store, args: list[str], ctx: int, log_path: Path, device: str = "cuda",
                log_level: str = "warning"):
    """A real `engine serve` subprocess (model: a checkpoint directory, or a GGUF file alone where store is None)
    on a free port; yields (base URL, seconds to ready, the command), stopped on leaving. log_level: its
    --log-level (info: the engine's own load lines reach log_path too)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "engine", "serve", "--model", str(model), *(["--store", str(store)] if store else []),
           "--device", device, "--port", str(port), "--ctx", str(ctx), "--max-batch", str(STREAMS),
           "--served-name", "synth", "--log-level", log_level, *args]
    logf = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        load_s = wait_ready(proc, base, log_path, "engine serve")
        yield base, round(load_s, 1), " ".join(["python3", "-m", "engine", "serve", *cmd[4:]])
    finally:
        stop(proc)
        logf.close()


def measure_served(base: str, vocab, steps, prefill, sampled) -> dict:
    """bench.harness.measure's requests through a running `engine serve`'s HTTP API, /metrics beside them."""
    usage: list[dict] = []
    res = measure(completions_client(base, "synth", usage), vocab, steps, prefill, sampled, lambda: metrics(base))
    res["streamed_usage_last"] = usage[-1] if usage else None
    res["streamed_usage_seen"] = len(usage)
    res["metrics_end"] = metrics(base)
    return res


def served(model_dir, store, args: list[str], vocab, steps, prefill, sampled, log_path: Path) -> dict:
    with kiln_server(model_dir, store, args, prefill + 512, log_path) as (base, load_s, command):
        res = measure_served(base, vocab, steps, prefill, sampled)
        res.update(load_s=load_s, command=command)
        return res


def window_bytes(res: dict, served_side: bool) -> dict:
    """Per-token PCIe and disk bytes over the timed 1-stream window."""
    w = res.pop("window_1_stream")
    a, b, n = w["before"], w["after"], max(1, w["tokens"] - 1)
    # PCIe: records copied into slots, and (zero-copy decode) records the kernels read in place
    if served_side:
        copied = b.get("kiln_pcie_bytes_total", 0) - a.get("kiln_pcie_bytes_total", 0)
        in_place = b.get("kiln_read_in_place_bytes_total", 0) - a.get("kiln_read_in_place_bytes_total", 0)
        disk = b.get("kiln_store_read_bytes_total", 0) - a.get("kiln_store_read_bytes_total", 0)
        host = None
    else:
        copied = b.get("pcie_bytes", 0) - a.get("pcie_bytes", 0)
        in_place = ((b.get("zero_copy") or {}).get("read_in_place_bytes", 0)
                    - (a.get("zero_copy") or {}).get("read_in_place_bytes", 0))
        disk = b["store_read_bytes"] - a["store_read_bytes"]
        host = (b.get("host_seconds", 0) - a.get("host_seconds", 0)) / n
    out = {"pcie": int((copied + in_place) / n), "pcie_read_in_place": int(in_place / n), "disk": int(disk / n)}
    if host is not None:
        out["host_seconds_per_token"] = round(host, 6)
    if not served_side:
        served_ = {k: b["served"][k] - a["served"][k] for k in b["served"]}
        tot = sum(served_.values()) or 1
        out["served_fraction"] = {k: round(v / tot, 4) for k, v in served_.items()}
    return out


def tiered_bound(bytes_tok: dict, tb: dict, lanes: dict, resident_step_s: float | None) -> dict:
    t_gpu = (tb["non_expert_bytes_per_token"] + tb["expert_bytes_per_token"]) / (lanes["hbm_gbps"] * 1e9)
    lanes_s = {"gpu_hbm": t_gpu, "pcie": bytes_tok["pcie"] / (lanes["pcie_h2d_pinned_gbps"] * 1e9),
               "disk": bytes_tok["disk"] / (lanes["disk_odirect_random_16t_gbps"] * 1e9), "cpu": 0.0}
    out = {"lane_seconds_per_token": {k: round(v, 6) for k, v in lanes_s.items()},
           "bound_tps": round(1 / max(lanes_s.values()), 1)}
    if resident_step_s:
        # issue 13's figure (0.138): the GPU lane at what the resident engine's step measured in this run
        meas = dict(lanes_s, gpu_hbm=max(t_gpu, resident_step_s))
        out["bound_tps_gpu_lane_measured"] = round(1 / max(meas.values()), 1)
    return out


def attach_bound(res: dict, tiered: bool, served_side: bool, tb: dict, lanes: dict, resident_step_s) -> None:
    """A run's lane bound and its fraction of it: tiered from the timed window's bytes per token, resident
    from the HBM bytes alone."""
    if tiered:
        res["bytes_per_token"] = window_bytes(res, served_side)
        res.update(tiered_bound(res["bytes_per_token"], tb, lanes, resident_step_s))
    else:
        res.pop("window_1_stream", None)
        res.update(resident_bound(tb, lanes))
    res["fraction_of_bound"] = round(res["decode_tps"] / res["bound_tps"], 3)


# ------------------------------------------------------------------ llama.cpp

def llama_bench(llama: Path, gguf: Path, extra: list[str]) -> dict:
    libs = [str(llama / "bin"), "/usr/local/cuda/lib64", "/usr/local/cuda-13.0/lib64", os.environ.get("LD_LIBRARY_PATH", "")]
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(filter(None, libs)))
    # -p 8192 -r 2: the 8k prefill and 128 decoded tokens, twice (-p 512,8192 -r 3 at two configs plus the
    # conversion ran past one device call's 600 s)
    cmd = [str(llama / "bin" / "llama-bench"), "-m", str(gguf), "-ngl", "99", "-p", "8192", "-n", "128", "-r", "2",
           "-o", "json", *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=200)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({r.returncode}): {r.stderr[-2000:]}")
    rows = json.loads(r.stdout)
    out = {"command": " ".join(["llama-bench", *cmd[1:]]), "seconds": round(time.perf_counter() - t0, 1),
           **llama_bench_figures(rows)}
    out["backends"] = sorted({row.get("backends", "") for row in rows})
    out["stderr_tail"] = r.stderr[-400:]
    return out


# ------------------------------------------------------------------ main

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/kiln-bench")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / f"{date.today()}-h200-served.json"))
    ap.add_argument("--tokenizer", required=True, help="a Qwen2 tokenizer directory (tokenizer.json + config)")
    ap.add_argument("--llama", default=None, help="llama.cpp: DIR/bin (llama-bench + libs), DIR/src (converter)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--skip", default="", help="comma list: resident,tiered,served,inprocess,llama")
    ap.add_argument("--llama-n-cpu-moe", action="store_true", help="also llama.cpp with --n-cpu-moe 7 (the 24 GB budget)")
    ap.add_argument("--configs", default="resident,resident_torch_ops,tiered_24gb",
                    help="comma list of: resident, resident_torch_ops (in-process, --no-fused-kernels: the A/B "
                         "baseline), tiered_24gb (zero-copy decode where the tiers hold every record), "
                         "tiered_24gb_piecewise (the same, --zero-copy off), tiered_24gb_uniform / "
                         "tiered_24gb_piecewise_uniform (in-process, routing replaced by a uniform trace), "
                         "tiered_24gb_cpu_auto / tiered_24gb_cpu_on (the same with "
                         "--cpu-experts auto/on: the CPU expert lane), resident_int4, budget_24gb_int4 (int4 records, "
                         "the 24 GB budget), resident_no_ahead / resident_int4_no_ahead (in-process, --no-decode-ahead: "
                         "decode ahead's A/B baseline), resident_sampled / resident_int4_sampled (temperature 1, "
                         "seeded: the GPU sampler)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"runs": {}}
    t_start = time.perf_counter()

    def save():
        result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
        write_result(out, result)

    props = torch.cuda.get_device_properties(0)
    result["machine"] = {"gpu": props.name, "sms": props.multi_processor_count, "cpus": os.cpu_count(),
                         "nvidia_smi": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                                       "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()}
    import transformers
    import triton
    result["versions"] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                          "triton": triton.__version__, "transformers": transformers.__version__}

    model_dir, store = work / "model", work / "store"
    t0 = time.perf_counter()
    if not (store / mf.MANIFEST).exists():
        syn = synthesize(model_dir, store, num_hidden_layers=args.layers)
    else:
        syn = {"reused": True}
    syn["seconds"] = round(time.perf_counter() - t0, 1)
    for f in Path(args.tokenizer).iterdir():
        shutil.copy(f, model_dir / f.name)
    model_manifest.write(model_dir)       # the tokenizer is part of the model `engine serve` verifies
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg["vocab_size"]
    m = mf.load(store)
    result["checkpoint"] = {"shape": {**QWEN3_30B_A3B, "num_hidden_layers": args.layers}, "synth": syn,
                            "records": len(m.records), "record_bytes": m.record_bytes,
                            "tokenizer": "Qwen2 (llama.cpp models/ggml-vocab-qwen2.gguf via transformers)"}
    lanes = measure_lanes(store / mf.DATA, m.record_bytes, len(m.records))
    lanes["dram_read_16t_gbps"] = dram_read_gbps(16)
    result["lanes"] = lanes
    log("lanes:", lanes)
    non_expert = (model_dir / "model.safetensors").stat().st_size
    tb = token_bytes(cfg, m.record_bytes, non_expert)
    result["token_bytes"] = tb
    kv = 2 * STREAMS * (args.prefill + 512) * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * args.layers
    gpu_slots = int((CARD_BYTES - non_expert - kv - WORKSPACE) // m.record_bytes)
    budget = {"card_bytes": CARD_BYTES, "non_expert_bytes": non_expert, "kv_cache_bytes": kv, "workspace_bytes": WORKSPACE,
              "gpu_slots": gpu_slots, "ram_slots": RAM_TIER // m.record_bytes, "records": len(m.records)}
    result["budget_24gb"] = budget
    wanted = args.configs.split(",")
    store4, tb4, budget4 = work / "store-int4", None, None
    if any("int4" in c for c in wanted):
        # the same seed's draws quantized (engine synth --quant int4): the same checkpoint, a quarter the bytes
        if not (store4 / mf.MANIFEST).exists():
            t0 = time.perf_counter()
            syn4 = synthesize(work / "model-int4", store4, num_hidden_layers=args.layers, quant="int4")
            syn4["seconds"] = round(time.perf_counter() - t0, 1)
            result["checkpoint"]["synth_int4"] = syn4
        m4 = mf.load(store4)
        tb4 = token_bytes(cfg, m4.record_bytes, non_expert)
        slots4 = int((CARD_BYTES - non_expert - kv - WORKSPACE) // m4.record_bytes)
        budget4 = {**budget, "record_bytes": m4.record_bytes, "gpu_slots": slots4,
                   "all_experts_fit": slots4 >= len(m4.records)}
        result["token_bytes_int4"], result["budget_24gb_int4"] = tb4, budget4
    save()

    configs = {    # name: (LLM.load knobs, engine serve flags, sampled, store, token bytes)
        "resident": ({"experts": "resident"}, ["--experts", "resident"], False, store, tb),
        "resident_torch_ops": ({"experts": "resident", "fused_kernels": False}, None, False, store, tb),
        # the A/B baseline of decode ahead (engine.llm): each step launched once the last one's tokens are read
        "resident_no_ahead": ({"experts": "resident", "decode_ahead": False}, None, False, store, tb),
        # decoded as the tiered runs are (sampled): the host's sampling per token beside the same GPU step
        "resident_sampled": ({"experts": "resident"}, None, True, store, tb),
        "tiered_24gb": ({"experts": "tiered", "gpu_slots": gpu_slots, "ram_slots": budget["ram_slots"], "readers": 16},
                        ["--experts", "tiered", "--gpu-slots", str(gpu_slots), "--ram-slots", str(budget["ram_slots"]),
                         "--readers", "16"], True, store, tb),
    }
    # the same budget decoded piecewise (a host step per MoE layer copies what a slot lacks), the baseline of
    # zero-copy decode, which tiered_24gb takes (its slots and RAM tier hold every record)
    kw, flags, sampled, st, t = configs["tiered_24gb"]
    configs["tiered_24gb_piecewise"] = ({**kw, "zero_copy": "off"}, [*flags, "--zero-copy", "off"], sampled, st, t)
    # issue 15's worst case: uniform routing (a labelled synthetic trace, in-process only), both decodes
    configs["tiered_24gb_uniform"] = (kw, None, sampled, st, t)
    configs["tiered_24gb_piecewise_uniform"] = ({**kw, "zero_copy": "off"}, None, sampled, st, t)
    for mode in ("auto", "on"):     # issue 15: the same budget with RAM-tier experts computed on the CPU lane
        kw, flags, sampled, st, t = configs["tiered_24gb"]
        configs[f"tiered_24gb_cpu_{mode}"] = ({**kw, "cpu_experts": mode}, [*flags, "--cpu-experts", mode], sampled, st, t)
    if budget4:
        configs["resident_int4"] = ({"experts": "resident"}, ["--experts", "resident"], False, store4, tb4)
        configs["resident_int4_no_ahead"] = ({"experts": "resident", "decode_ahead": False}, None, False, store4, tb4)
        # temperature 1, seeded, in-process and served: sampled on the GPU, decoding ahead (engine.sampling)
        configs["resident_int4_sampled"] = ({"experts": "resident"}, ["--experts", "resident"], True, store4, tb4)
        # auto placement under the 24 GB card's slots: int4 records all fit, so it must pick resident
        configs["budget_24gb_int4"] = ({"experts": "auto", "gpu_slots": budget4["gpu_slots"],
                                        "ram_slots": budget["ram_slots"], "readers": 16},
                                       ["--experts", "auto", "--gpu-slots", str(budget4["gpu_slots"]), "--ram-slots",
                                        str(budget["ram_slots"]), "--readers", "16"], False, store4, tb4)
    resident_step = None
    for name, (kw, flags, sampled, store_, tb_) in configs.items():
        if name not in wanted or name.split("_")[0] in skip:
            continue
        run: dict = {}
        if "inprocess" not in skip:
            r, c = inprocess(model_dir, store_, kw, vocab, args.steps, args.prefill, sampled, name.endswith("_uniform"))
            attach_bound(r, sampled, False, tb_, lanes, resident_step if name.startswith("tiered_24gb") else None)
            if name == "resident":
                resident_step = 1 / r["decode_tps"]
            r["counters_end"] = c
            run["inprocess"] = r
            result["runs"][name] = run
            save()
            log(f"{name} in-process:", {k: v for k, v in r.items() if k not in ("counters_end",)})
        if "served" not in skip and flags is not None:
            s = served(model_dir, store_, flags, vocab, args.steps, args.prefill, sampled, work / f"serve-{name}.log")
            attach_bound(s, sampled, True, tb_, lanes, resident_step if name.startswith("tiered_24gb") else None)
            if "inprocess" in run:
                s["served_over_inprocess"] = {k: round(s[k] / run["inprocess"][k], 3) for k in
                                              ("decode_tps", "decode_tps_4_streams_aggregate", "prefill_tps")
                                              if s.get(k) and run["inprocess"].get(k)}
            run["served"] = s
            result["runs"][name] = run
            save()
            log(f"{name} served:", {k: v for k, v in s.items() if k not in ("metrics_end",)})
    gc.collect()
    torch.cuda.empty_cache()

    if args.llama and "llama" not in skip:
        llama = Path(args.llama)
        gguf = work / "synth-bf16.gguf"
        try:
            result["gguf"] = gguf_convert(model_dir, store, llama / "src", gguf)
            save()
            peer = {"all_gpu_bf16": llama_bench(llama, gguf, [])}
            peer["all_gpu_bf16"].update(resident_bound(tb, lanes))
            save()
            a = peer["all_gpu_bf16"]
            a["fraction_of_bound"] = round(a["decode_tps"] / a["bound_tps"], 3)
            if not args.llama_n_cpu_moe:
                raise StopIteration
            cpu = llama_bench(llama, gguf, ["--n-cpu-moe", "7"])
            cpu_bytes = 7 * cfg["num_experts_per_tok"] * m.record_bytes
            t = {"gpu_hbm": (tb["non_expert_bytes_per_token"] + 17 * cfg["num_experts_per_tok"] * m.record_bytes) / (lanes["hbm_gbps"] * 1e9),
                 "cpu": cpu_bytes / (lanes["dram_read_16t_gbps"] * 1e9)}
            cpu.update({"lane_seconds_per_token": {k: round(v, 6) for k, v in t.items()},
                        "bound_tps": round(1 / max(t.values()), 1), "layers_experts_on_cpu": 7})
            peer["n_cpu_moe_7_bf16"] = cpu
            for p in peer.values():
                p["fraction_of_bound"] = round(p["decode_tps"] / p["bound_tps"], 3)
            result["runs"]["llama_cpp"] = peer
        except StopIteration:
            result["runs"]["llama_cpp"] = peer
        except Exception as e:            # the peer failing must not lose Kiln's figures
            result["runs"]["llama_cpp"] = {"error": str(e)[-3000:]}
        save()
        log("llama.cpp:", result["runs"]["llama_cpp"])

    # --- targets (issue 13)
    runs = result["runs"]
    t: dict = {}
    res_, tie, peer = runs.get("resident", {}), runs.get("tiered_24gb", {}), runs.get("llama_cpp", {})
    for name, r in (("resident", res_), ("tiered_24gb", tie)):
        if "served" in r and "inprocess" in r:
            t[f"{name}_served_over_inprocess_decode"] = r["served"]["served_over_inprocess"].get("decode_tps")
    if "inprocess" in tie:
        t["tiered_inprocess_fraction_of_bound_gpu_lane_measured"] = round(
            tie["inprocess"]["decode_tps"] / tie["inprocess"].get("bound_tps_gpu_lane_measured", tie["inprocess"]["bound_tps"]), 3)
        t["tiered_inprocess_fraction_of_bound_hbm"] = tie["inprocess"]["fraction_of_bound"]
    if "all_gpu_bf16" in peer and "inprocess" in res_:
        t["resident_over_llama_cpp_all_gpu_decode"] = round(res_["inprocess"]["decode_tps"] / peer["all_gpu_bf16"]["decode_tps"], 3)
        if "served" in res_:
            t["resident_served_over_llama_cpp_all_gpu_decode"] = round(res_["served"]["decode_tps"] / peer["all_gpu_bf16"]["decode_tps"], 3)
    if "n_cpu_moe_7_bf16" in peer and "inprocess" in tie:
        t["tiered_over_llama_cpp_n_cpu_moe_7_decode"] = round(tie["inprocess"]["decode_tps"] / peer["n_cpu_moe_7_bf16"]["decode_tps"], 3)
    ops = runs.get("resident_torch_ops", {}).get("inprocess")
    if ops and "inprocess" in res_:
        t["resident_fused_over_torch_ops_decode"] = round(res_["inprocess"]["decode_tps"] / ops["decode_tps"], 3)
    for base in ("resident", "resident_int4"):      # decode ahead's A/B, in-process, same run
        on, off = runs.get(base, {}).get("inprocess"), runs.get(f"{base}_no_ahead", {}).get("inprocess")
        if on and off:
            t[f"{base}_ahead_over_no_ahead_decode"] = round(on["decode_tps"] / off["decode_tps"], 3)
    r4 = runs.get("resident_int4", {}).get("inprocess")
    if r4 and "inprocess" in res_:
        t["resident_int4_over_bf16_decode"] = round(r4["decode_tps"] / res_["inprocess"]["decode_tps"], 3)
    b4 = runs.get("budget_24gb_int4", {}).get("inprocess")
    if b4:
        t["budget_24gb_int4_provider"] = b4["provider"]
        if "inprocess" in tie:
            t["budget_24gb_int4_over_tiered_bf16_decode"] = round(b4["decode_tps"] / tie["inprocess"]["decode_tps"], 3)
    result["targets"] = {**t, "required": {"served_over_inprocess_decode": ">= 0.9",
                                          "resident_int4_over_bf16_decode": ">= 1.5",
                                          "tiered_fraction_of_bound": ">= 0.6",
                                          "resident_over_llama_cpp_all_gpu_decode": ">= 1.0"}}
    save()

    log("\n| run | side | decode tok/s | 4 streams agg | TTFT 128 (s) | 8k prefill tok/s | new length tok/s | "
        "bound tok/s | of bound |")
    log("|---|---|---|---|---|---|---|---|---|")
    for name in configs:
        for side, r in runs.get(name, {}).items():
            log(f"| {name} | {side} | {r['decode_tps']} | {r['decode_tps_4_streams_aggregate']} | {r['ttft_s_128_prompt']} | "
                f"{r['prefill_tps']} | {r.get('prefill_new_length_tps')} | {r['bound_tps']} | {r['fraction_of_bound']} |")
    for name, r in peer.items() if isinstance(peer, dict) and "error" not in peer else []:
        log(f"| llama.cpp {name} | llama-bench | {r.get('decode_tps')} | | | {r.get('prefill_tps_8192')} | | "
            f"{r.get('bound_tps')} | {r.get('fraction_of_bound')} |")
    log("targets:", json.dumps(result["targets"]))
    log("wrote", out)


if __name__ == "__main__":
    main()

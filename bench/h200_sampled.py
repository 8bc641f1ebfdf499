"""Issue 32's sampled-decode target in one H200 run, all on the GPU, on the same weights: Kiln int4 resident greedy and
at temperature 1 (seeded), served through HTTP and in-process, beside llama.cpp's Q4_K_M (made by llama-quantize
from the same weights) under `llama-bench` and under `llama-server` sampling at the same settings.

  python -m bench.h200_sampled --work /tmp/ks --tokenizer DIR --llama DIR --layers 16 --out $OUT/h200-sampled.json

1. engine synth's checkpoint (Qwen3-30B-A3B's shape, seed 0, --layers of its 48; 24 in the other H200 benches,
   fewer here so that the whole comparison, weight build and conversion included, fits one 8-minute device call):
   bf16 (what llama.cpp converts) and int4 records (what Kiln serves), Qwen2's tokenizer (--tokenizer).
2. Kiln, every expert resident, int4: a real `engine serve --device cuda` through HTTP and, last (not judged),
   in-process (LLM.load, the entry `engine serve` uses), each greedy and at temperature 1 with a per-request seed
   (h200_served's requests: bench.harness.measure; the sampler is captured in the decode graph,
   engine.gpu.sampler_graph).
3. llama.cpp (--llama DIR: DIR/bin with llama-bench, llama-quantize, llama-server and their libraries, DIR/src the
   converter; bench/h200_peer.py's docstring says how the folder is made): the same bf16 weights to GGUF with its
   own converter class, `llama-quantize` Q4_K_M, `llama-bench -p 512 -n STEPS -r 2` (no sampler: its best case),
   and `llama-server` through the same client and requests at temperature 1 with the same seeds, its sampler
   chain reduced to temperature alone (`--samplers temperature`: no top-k 40, top-p 0.95 or min-p 0.05 of its
   defaults, so both servers draw from the whole softmax, as Kiln's API defaults do).
4. Targets (issue 32, all on the GPU, temperature 1): Kiln's served sampled decode >= 0.95x its greedy,
   >= 1.1x llama-bench and >= 1.2x llama-server sampling.
Writes --out after every part (a part that fails or does not fit --budget-s is recorded as such); prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

from bench.h200_served import inprocess, served
from bench.harness import (REPO, completions_client, free_port, gguf_convert, llama_bench_figures, log, machine,
                           measure, stop, wait_ready, write_result)
from engine.measure.peer import STREAMS
from engine.store import manifest as mf
from engine.store import model_manifest
from engine.synth import QWEN3_30B_A3B, synthesize

TARGETS = {"sampled_over_greedy_served": 0.95, "sampled_served_over_llama_bench": 1.1,
           "sampled_served_over_llama_server_sampled": 1.2}


class Skipped(Exception):
    pass


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def need(self, seconds: float, what: str) -> None:
        if self.left() < seconds:
            raise Skipped(f"{what}: {self.left():.0f} s left of the call's {self.budget:.0f}, it needs ~{seconds:.0f}")

    def part(self, name: str, seconds: float, fn):
        """fn()'s result where ~`seconds` are left, else {"skipped": why}; a part that fails gives {"error": ...}
        (one part failing must not lose the others' figures)."""
        t0 = time.perf_counter()
        try:
            self.need(seconds, name)
            return fn()
        except Skipped as e:
            log(f"{name}: skipped: {e}")
            return {"skipped": str(e)}
        except Exception as e:
            log(f"{name}: FAILED: {type(e).__name__}: {e}")
            return {"error": f"{type(e).__name__}: {str(e)[-3000:]}"}
        finally:
            log(f"== {name}: {time.perf_counter() - t0:.1f} s ({self.left():.0f} s left)")


def llama_env(bin_dir: Path) -> dict:
    libs = [str(bin_dir), "/usr/local/cuda/lib64", "/usr/local/cuda-13.0/lib64", os.environ.get("LD_LIBRARY_PATH", "")]
    return dict(os.environ, LD_LIBRARY_PATH=":".join(filter(None, libs)))


def quantize(bin_dir: Path, bf16: Path, out: Path, timeout_s: float) -> dict:
    cmd = [str(bin_dir / "llama-quantize"), str(bf16), str(out), "Q4_K_M"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=llama_env(bin_dir), timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"llama-quantize failed ({r.returncode}): {r.stderr[-2000:]}")
    return {"command": " ".join(["llama-quantize", *cmd[1:]]), "seconds": round(time.perf_counter() - t0, 1),
            "gguf_bytes": out.stat().st_size}


def llama_bench(bin_dir: Path, gguf: Path, steps: int, timeout_s: float) -> dict:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-ngl", "99", "-p", "512", "-n", str(steps), "-r", "2",
           "-o", "jsonl"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=llama_env(bin_dir), timeout=timeout_s)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    out = {"command": " ".join(["llama-bench", *cmd[1:]]), "seconds": round(time.perf_counter() - t0, 1),
           **llama_bench_figures(rows)}
    if rows:
        out.update({k: rows[0].get(k) for k in ("backends", "n_threads", "flash_attn", "build_number")})
    if r.returncode != 0:
        out["error"] = f"llama-bench exited {r.returncode}: {r.stderr[-1500:]}"
    return out


def llama_server_sampled(bin_dir: Path, gguf: Path, vocab: int, steps: int, prefill: int, log_path: Path,
                         limit_s: float) -> dict:
    """llama-server all on the GPU through h200_served's client and requests, sampled (temperature 1, the requests'
    seeds), its chain reduced to temperature alone."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "-ngl", "99", "-c", str(STREAMS * (prefill + 512)),
           "-np", str(STREAMS), "--host", "127.0.0.1", "--port", str(port), "--alias", "synth",
           "--samplers", "temperature"]
    logf = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=llama_env(bin_dir), start_new_session=True)
    try:
        load_s = wait_ready(proc, base, log_path, "llama-server", limit_s=min(300, limit_s))
        maps = Path(f"/proc/{proc.pid}/maps").read_text().splitlines()
        backends = sorted({line.split()[-1] for line in maps if "/libggml-" in line and line.split()[-1].endswith(".so")})
        usage: list[dict] = []
        res = measure(completions_client(base, "synth", usage), vocab, steps, prefill, True)
        res.update(load_s=round(load_s, 1), streamed_usage_seen=len(usage), backends_loaded=backends,
                   command=" ".join(["llama-server", *cmd[1:]]))
        return res
    finally:
        stop(proc)
        logf.close()


def ratios(runs: dict) -> dict:
    kiln = runs.get("kiln_int4_resident", {})
    g, s = kiln.get("served_greedy", {}).get("decode_tps"), kiln.get("served_sampled", {}).get("decode_tps")
    gi, si = kiln.get("inprocess_greedy", {}).get("decode_tps"), kiln.get("inprocess_sampled", {}).get("decode_tps")
    lb = runs.get("llama_bench_q4_k_m", {}).get("decode_tps")
    ls = runs.get("llama_server_q4_k_m_sampled", {}).get("decode_tps")
    out = {}
    if g and s:
        out["sampled_over_greedy_served"] = round(s / g, 3)
    if gi and si:
        out["sampled_over_greedy_inprocess"] = round(si / gi, 3)
    if s and lb:
        out["sampled_served_over_llama_bench"] = round(s / lb, 3)
    if s and ls:
        out["sampled_served_over_llama_server_sampled"] = round(s / ls, 3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/kiln-sampled")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / f"{date.today()}-h200-sampled.json"))
    ap.add_argument("--tokenizer", required=True, help="a Qwen2 tokenizer directory (tokenizer.json + config)")
    ap.add_argument("--llama", required=True, help="llama.cpp: DIR/bin (llama-bench, llama-quantize, llama-server, "
                                                   "libraries), DIR/src (the converter)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048, help="the long prompt of measure()'s prefill figures")
    ap.add_argument("--budget-s", type=float, default=500, help="the call's time: parts that do not fit are skipped")
    args = ap.parse_args()
    clock = Clock(args.budget_s)
    work, llama = Path(args.work), Path(args.llama)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import transformers
    result: dict = {"command": " ".join(["python", "-m", "bench.h200_sampled", *sys.argv[1:]]),
                    "machine": machine(), "runs": {}, "targets": {k: f">= {v}" for k, v in TARGETS.items()},
                    "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                                 "transformers": transformers.__version__},
                    "settings": {"layers": args.layers, "steps": args.steps, "prefill": args.prefill,
                                 "sampled": "temperature 1, each request's own seed, no top-k/top-p/min-p (both servers)"}}
    runs = result["runs"]

    def save():
        result["wall_seconds"] = round(clock.budget - clock.left(), 1)
        result["ratios"] = r = ratios(runs)
        result["verdicts"] = {k: ("met" if r[k] >= v else "missed") for k, v in TARGETS.items() if k in r}
        write_result(out, result)

    part = clock.part

    # 1. the weights
    model_dir, store, store4 = work / "model", work / "store", work / "store-int4"
    shape = {**QWEN3_30B_A3B, "num_hidden_layers": args.layers}
    t0 = time.perf_counter()
    have = (store / mf.MANIFEST).exists() or (work / "synth-q4_k_m.gguf").exists()
    syn = synthesize(model_dir, store, num_hidden_layers=args.layers) if not have else {"reused": True}
    syn4 = (synthesize(work / "model-int4", store4, num_hidden_layers=args.layers, quant="int4")
            if not (store4 / mf.MANIFEST).exists() else {"reused": True})
    for f in Path(args.tokenizer).iterdir():
        shutil.copy(f, model_dir / f.name)
    model_manifest.write(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    result["checkpoint"] = {"shape": shape, "synth": syn, "synth_int4": syn4, "seconds": round(time.perf_counter() - t0, 1),
                            "record_bytes_int4": mf.load(store4).record_bytes}
    log("weights:", result["checkpoint"])
    save()

    # 2. Kiln, int4 resident, served: greedy and sampled (the judged figures first)
    kiln = runs["kiln_int4_resident"] = {}

    def kiln_inprocess(sampled: bool) -> dict:
        r, c = inprocess(model_dir, store4, {"experts": "resident"}, vocab, args.steps, args.prefill, sampled)
        # the evidence that the sampler ran in its graph: one replay a decode step
        r["counters"] = {k: c.get(k) for k in ("decode_graph_replays", "decode_sampler_graph_replays",
                                               "decode_ahead_steps_total", "decode_ahead_redone_total")}
        return r
    def kiln_served(sampled: bool, key: str) -> dict:
        r = served(model_dir, store4, ["--experts", "resident"], vocab, args.steps, args.prefill, sampled,
                   work / f"serve-{key}.log")
        m = r.get("metrics_end") or {}
        r["counters"] = {k: m.get(f"kiln_{k}_total") for k in ("decode_graph_replays", "decode_sampler_graph_replays",
                                                                  "decode_ahead_steps", "decode_ahead_redone")}
        return r
    for sampled in (False, True):
        key = "sampled" if sampled else "greedy"
        kiln[f"served_{key}"] = part(f"kiln served {key}", 50, lambda: kiln_served(sampled, key))
        log(f"kiln served {key}:", {k: kiln[f'served_{key}'].get(k) for k in ("decode_tps", "decode_tps_4_streams_aggregate",
                                                                             "counters", "error", "skipped")})
        save()

    # 3. llama.cpp on the same weights: GGUF bf16, Q4_K_M, llama-bench, llama-server sampled
    bf16, q4 = work / "synth-bf16.gguf", work / "synth-q4_k_m.gguf"

    def make_q4():
        conv = gguf_convert(model_dir, store, llama / "src", bf16, timeout_s=max(1, clock.left() - 120))
        shutil.rmtree(store)        # Kiln reads store-int4; the device's 64 GiB hold the bf16 store or its GGUF+Q4
        quant = quantize(llama / "bin", bf16, q4, timeout_s=max(1, clock.left() - 60))
        bf16.unlink()
        return {"convert": {k: v for k, v in conv.items() if k != "log_tail"}, "quantize": quant}
    result["gguf"] = part("GGUF bf16 + llama-quantize Q4_K_M", 40 + 12 * args.layers, make_q4) if not q4.exists() \
        else {"reused": True}
    save()
    if q4.exists():
        runs["llama_bench_q4_k_m"] = part("llama-bench Q4_K_M", 30,
                                          lambda: llama_bench(llama / "bin", q4, args.steps, clock.left() - 5))
        log("llama-bench:", runs["llama_bench_q4_k_m"])
        save()
        runs["llama_server_q4_k_m_sampled"] = part(
            "llama-server Q4_K_M sampled", 40,
            lambda: llama_server_sampled(llama / "bin", q4, vocab, args.steps, args.prefill,
                                         work / "llama-server.log", clock.left() - 5))
        save()

    # 4. Kiln in-process (not judged: last, where the call's time allows)
    for sampled in (False, True):
        key = "sampled" if sampled else "greedy"
        kiln[f"inprocess_{key}"] = part(f"kiln in-process {key}", 45, lambda: kiln_inprocess(sampled))
        log(f"kiln in-process {key}:", {k: kiln[f'inprocess_{key}'].get(k) for k in ("decode_tps", "counters", "error")})
        save()

    # 5. the table
    save()
    log("\n| engine | how | decode tok/s (1 stream) | 4 streams aggregate | TTFT 128 (s) |")
    log("|---|---|---|---|---|")
    for name, r in [(f"Kiln int4 {k.replace('_', ' ')}", v) for k, v in kiln.items()] + [
            ("llama.cpp Q4_K_M llama-bench", runs.get("llama_bench_q4_k_m", {})),
            ("llama.cpp Q4_K_M llama-server, temperature 1", runs.get("llama_server_q4_k_m_sampled", {}))]:
        log(f"| {name} | {r.get('decoding', 'no sampler')} | {r.get('decode_tps')} | "
            f"{r.get('decode_tps_4_streams_aggregate', '')} | {r.get('ttft_s_128_prompt', '')} |")
    log("ratios:", result["ratios"], "verdicts:", result["verdicts"])
    log(f"wrote {out} ({result['wall_seconds']} s)")


if __name__ == "__main__":
    main()

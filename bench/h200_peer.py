"""llama.cpp, the peer users would pick, on the same synthetic checkpoint, machine and 24 GB budget as Kiln's
served bench (bench/h200_served.py), in phases that each fit one device call (issue 15).

  python -m bench.h200_peer --phase convert --work /tmp/kp --llama-bin DIR --llama-src DIR/src --out-dir $OUT
  python -m bench.h200_peer --phase quantize,bench-bf16 ...        # phases run in the order given
  python -m bench.h200_peer --phase report --from DIR... --kiln bench/results/<date>-h200-served.json \
      --out bench/results/<date>-h200-peer.json                    # anywhere, no GPU: merges the phases' JSON
  python -m bench.h200_peer --tiny --phase all --work /tmp/kpt --llama-bin .kiln/cache/llama.cpp/bin \
      --llama-src DIR/src --out-dir /tmp/kpt/out                    # the CPU dry run of every phase

--llama-bin: llama-bench, llama-quantize, llama-server and their libraries (on the device: the peer tarball of
../shared/peers/llama.cpp-cuda-sm90 with scripts/build-llama-cpp.sh --server-dl's tarball unpacked over it).
--llama-src: the converter from the same sdist (convert_hf_to_gguf.py's conversion/, gguf-py/,
models/ggml-vocab-qwen2.gguf; the --server-dl tarball's src/).

Phases (each writes <out-dir>/peer-<phase>.json, and prints its timings; each redoes what it needs that is
not in --work, since a device call may land on a fresh machine):
  convert      engine synth's checkpoint (24 layers of Qwen3-30B-A3B's shape, seed 0: h200_served's weights),
               GGUF bf16 with llama.cpp's own converter class (bench/gguf_from_store.py), this machine's lanes.
               Then the store is deleted unless --keep-store: store 29 GB + GGUF 31 GB + Q4_K_M 9 GB do not fit
               the device's 64 GiB disk together (run Kiln's bench before this phase, not after).
  quantize     llama-quantize bf16 -> Q4_K_M.
  bench-bf16, bench-q4
               llama-bench -p 512,8192 -n 128 -r 2, all on the GPU and with --n-cpu-moe N at the 24 GB budget
               (budget_n_cpu_moe says how N is found), plus --extra-n-cpu-moe; peak GPU memory beside each.
  serve-bf16, serve-q4
               the new llama-server through HTTP with h200_served's client and requests: 1 stream, 4 streams
               aggregate, TTFT of a 128-token prompt, 8k prefill; all on the GPU (greedy, as Kiln's resident
               run) and at the budget's N (sampled at temperature 1, seeded, as Kiln's tiered run).
  report       the table and one JSON from the phases' files, beside Kiln's served figures (--kiln).
Every figure stands beside its lane bound: t >= max(t_gpu = B_gpu/BW_hbm, t_cpu = B_cpu/BW_dram), bytes per
token from the GGUF's own tensor sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.harness import (completions_client, free_port, gguf_convert, host_load, llama_bench_figures, log,
                           machine, measure, stop, wait_ready, write_result)
from engine.measure.peer import STREAMS, budget_n_cpu_moe, gguf_tensors, lane_bound, report, token_bytes

PHASES = ("convert", "quantize", "bench-bf16", "bench-q4", "serve-bf16", "serve-q4", "report")
QUANTS = {"bf16": "synth-bf16.gguf", "q4": "synth-q4_k_m.gguf"}
# The CPU dry run's shape: every code path of the 24-layer run, small enough for two shared cores. The vocabulary
# stays Qwen's (the converter takes it from ggml-vocab-qwen2.gguf); rows of 256 so Q4_K_M's super-blocks apply.
TINY_SHAPE = dict(num_hidden_layers=2, hidden_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)


class Clock:
    """The call's time: phases check what is left before starting a step that could overrun the call's limit."""

    def __init__(self, budget_s: float):
        self.t0, self.budget_s = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.t0, 1)


class Skipped(Exception):
    """A step not started because the call's time would not cover it."""


def need(clock: Clock, seconds: float, what: str) -> None:
    if clock.left() < seconds:
        raise Skipped(f"{what}: needs ~{seconds:.0f} s, {max(0, clock.left()):.0f} s left of this call's "
                      f"{clock.budget_s:.0f} s (run it in the next call)")


def llama_env(bin_dir: Path) -> dict:
    libs = [str(bin_dir), "/usr/local/cuda/lib64", "/usr/local/cuda-13.0/lib64", os.environ.get("LD_LIBRARY_PATH", "")]
    return dict(os.environ, LD_LIBRARY_PATH=":".join(filter(None, libs)))


class GpuMemoryPeak:
    """Peak memory.used of GPU 0 while the block runs, from `nvidia-smi -lms 100` (None where there is none):
    the evidence that a placement stays inside the 24 GiB budget (../shared/BENCH.md: polled at least every 100 ms)."""

    def __enter__(self):
        self.peak_mib = self.idle_mib = None
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            return self
        q = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
        self.idle_mib = int(subprocess.run(q, capture_output=True, text=True).stdout.split()[0])
        self.proc = subprocess.Popen([*q, "-lms", "100"], stdout=subprocess.PIPE, text=True)
        self.peak_mib = self.idle_mib

        def read():
            for line in self.proc.stdout:
                if line.strip().isdigit():
                    self.peak_mib = max(self.peak_mib, int(line))
        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        return self

    def __exit__(self, *exc):
        if self.proc:
            self.proc.terminate()
            self.proc.wait()
            self.reader.join(5)

    def result(self) -> dict:
        if self.peak_mib is None:
            return {"gpu_memory_peak_gib": None}
        return {"gpu_memory_peak_gib": round(self.peak_mib / 1024, 2),
                "gpu_memory_over_idle_gib": round((self.peak_mib - self.idle_mib) / 1024, 2)}


# ------------------------------------------------------------------ what the GGUF holds, and the budget

# ------------------------------------------------------------------ the work directory

class Work:
    def __init__(self, args):
        self.args = args
        self.dir = Path(args.work)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model, self.store = self.dir / "model", self.dir / "store"
        self.bin, self.src = Path(args.llama_bin), Path(args.llama_src)
        self.tiny = args.tiny

    def gguf(self, quant: str) -> Path:
        return self.dir / QUANTS[quant]

    def cfg(self) -> dict:
        return json.loads((self.model / "config.json").read_text())

    def lanes(self) -> dict | None:
        p = self.dir / "lanes.json"
        return json.loads(p.read_text()) if p.exists() else None


def synth(w: Work, clock: Clock) -> dict:
    from engine.store import manifest as mf
    from engine.synth import synthesize
    if (w.store / mf.MANIFEST).exists() and (w.model / "config.json").exists():
        return {"reused": True}
    need(clock, 30 if w.tiny else 150, "engine synth (29 GB of experts)")
    t0 = time.perf_counter()
    shape = TINY_SHAPE if w.tiny else {"num_hidden_layers": 24}
    out = synthesize(w.model, w.store, device="cpu" if w.tiny else None, **shape)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    log(f"synth: {out}")
    return out


def measure_lanes_here(w: Work, sample_file: Path) -> dict | None:
    """HBM, pinned PCIe, O_DIRECT disk, DRAM read: the harness's probes (CUDA only)."""
    import torch
    if not torch.cuda.is_available():
        return None
    from bench.harness import dram_read_gbps, measure_lanes
    record = 9437184                                    # one bf16 expert record of this shape (4 KiB-aligned)
    lanes = measure_lanes(sample_file, record, sample_file.stat().st_size // record)
    lanes["dram_read_16t_gbps"] = dram_read_gbps(16)
    torch.cuda.empty_cache()                # llama.cpp's runs after this get the GPU back (less this process's context)
    lanes = {k: round(v, 2) for k, v in lanes.items()}
    lanes["measured_on"] = str(sample_file)
    (w.dir / "lanes.json").write_text(json.dumps(lanes) + "\n")
    return lanes


def cached(path: Path, res: dict, key: str, make) -> Path:
    """`path` as it is in --work, else made by make(partial) -> its record under res[key], then renamed into place
    (a call killed half-way leaves only the .partial)."""
    if path.exists():
        res.setdefault(key, {"reused": True, "bytes": path.stat().st_size})
        return path
    partial = path.with_suffix(".gguf.partial")
    res[key] = make(partial)
    os.replace(partial, path)
    log(f"{key}: {res[key]['seconds']} s, {path.stat().st_size / 1e9:.2f} GB")
    return path


def ensure_bf16(w: Work, clock: Clock, res: dict) -> Path:
    def make(partial: Path) -> dict:
        res["synth"] = synth(w, clock)
        need(clock, 40 if w.tiny else 240, "GGUF bf16 conversion (182 s on the H200 last time)")
        return gguf_convert(w.model, w.store, w.src, partial, timeout_s=max(1, clock.left()))
    return cached(w.gguf("bf16"), res, "gguf_bf16", make)


def ensure_q4(w: Work, clock: Clock, res: dict) -> Path:
    def make(partial: Path) -> dict:
        bf16 = ensure_bf16(w, clock, res)
        need(clock, 20 if w.tiny else 200, "llama-quantize Q4_K_M")
        cmd = [str(w.bin / "llama-quantize"), str(bf16), str(partial), "Q4_K_M"]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=llama_env(w.bin), timeout=max(1, clock.left()))
        if r.returncode != 0:
            raise RuntimeError(f"llama-quantize failed ({r.returncode}): {r.stderr[-2000:]}")
        return {"command": " ".join(["llama-quantize", *cmd[1:]]), "seconds": round(time.perf_counter() - t0, 1),
                "gguf_bytes": partial.stat().st_size, "log_tail": (r.stdout + r.stderr)[-800:]}
    return cached(w.gguf("q4"), res, "gguf_q4", make)


def ensure_lanes(w: Work, gguf: Path, res: dict) -> dict | None:
    lanes = w.lanes() or measure_lanes_here(w, gguf)
    res["lanes"] = lanes
    return lanes


# ------------------------------------------------------------------ phases

def phase_convert(w: Work, clock: Clock, res: dict) -> None:
    gguf = ensure_bf16(w, clock, res)
    ensure_lanes(w, gguf, res)
    if w.store.exists() and not w.args.keep_store:
        shutil.rmtree(w.store)                   # the peer reads only the GGUF from here on (disk: see the docstring)
        res["store_deleted"] = True


def phase_quantize(w: Work, clock: Clock, res: dict) -> None:
    ensure_q4(w, clock, res)


def configs_for(w: Work, quant: str, gguf: Path, res: dict) -> list[tuple[str, int]]:
    """(name, --n-cpu-moe) per run: all on the GPU, the budget's N, and the extras asked for."""
    cfg = w.cfg()
    tensors = gguf_tensors(gguf)
    budget = budget_n_cpu_moe(tensors, cfg, w.args.prefill)
    res["budget_24gb"] = budget
    runs = [("all_gpu", 0)]
    if budget["n_cpu_moe"]:
        runs.append((f"n_cpu_moe_{budget['n_cpu_moe']}_budget", budget["n_cpu_moe"]))
    for n in w.args.extra_n_cpu_moe.get(quant, []):
        if n not in [m for _, m in runs]:
            runs.append((f"n_cpu_moe_{n}", min(n, cfg["num_hidden_layers"])))
    res["token_bytes"] = {name: token_bytes(tensors, cfg, n) for name, n in runs}
    log(f"{quant}: budget N = {budget['n_cpu_moe']} ({budget['expert_records_on_gpu']} expert records on the GPU, "
        f"Kiln's formula {budget['kiln_formula_gpu_slots']}); runs {runs}")
    return runs


def llama_bench(w: Work, gguf: Path, n_cpu_moe: int, timeout_s: float, repack: bool = True) -> dict:
    """One llama-bench process (the model loaded once): -p prompts -n gen -r reps, JSON lines so the tests that
    finished survive a timeout. A segfault is retried once with CPU weight repacking off (see --no-repack)."""
    a = w.args
    cmd = [str(w.bin / "llama-bench"), "-m", str(gguf), "-ngl", "99", "-p", a.bench_prompts, "-n", str(a.bench_gen),
           "-r", str(a.reps), "-o", "jsonl"] + (["--n-cpu-moe", str(n_cpu_moe)] if n_cpu_moe else []) \
        + (["--repack", "0"] if a.no_repack or not repack else [])
    out: dict = {"command": " ".join(["llama-bench", *cmd[1:]])}
    t0 = time.perf_counter()
    with GpuMemoryPeak() as mem:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=llama_env(w.bin))
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            out["timed_out_after_s"] = round(timeout_s, 1)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out.update(mem.result())
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    out.update(llama_bench_figures(rows))
    if rows:
        out.update({k: rows[0].get(k) for k in ("backends", "n_threads", "n_batch", "n_ubatch", "flash_attn", "build_number")})
    out["stderr_tail"] = stderr[-400:]
    if proc.returncode != 0 and "timed_out_after_s" not in out:
        out["error"] = f"llama-bench exited {proc.returncode}: {stderr[-1500:]}"
        if proc.returncode == -11 and repack and not a.no_repack and timeout_s - out["seconds"] > 30:
            retry = llama_bench(w, gguf, n_cpu_moe, timeout_s - out["seconds"], repack=False)
            retry["first_attempt"] = out
            return retry
    return out


def phase_bench(w: Work, clock: Clock, res: dict, quant: str) -> None:
    gguf = ensure_q4(w, clock, res) if quant == "q4" else ensure_bf16(w, clock, res)
    lanes = ensure_lanes(w, gguf, res)
    runs = {}
    for name, n in configs_for(w, quant, gguf, res):
        try:
            need(clock, 20 if w.tiny else 75, f"llama-bench {quant} {name}")
        except Skipped as e:
            runs[name] = {"skipped": str(e)}
            continue
        r = llama_bench(w, gguf, n, timeout_s=clock.left() - 10)
        r.update({"n_cpu_moe": n, **lane_bound(res["token_bytes"][name], lanes)})
        if r.get("decode_tps") and r.get("bound_tps"):
            r["fraction_of_bound"] = round(r["decode_tps"] / r["bound_tps"], 3)
        runs[name] = r
        log(f"llama-bench {quant} {name} ({r['seconds']} s): decode {r.get('decode_tps')} tok/s, "
            f"prefill {[(k, v) for k, v in r.items() if k.startswith('prefill_tps')]}, peak {r.get('gpu_memory_peak_gib')} GiB")
    res["llama_bench"] = runs


def llama_served(w: Work, gguf: Path, n_cpu_moe: int, sampled: bool, vocab: int, log_path: Path, clock: Clock) -> dict:
    """A real llama-server subprocess measured with h200_served's client and requests."""
    a = w.args
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # 4 slots of (8k + 512) tokens each: the context and batch Kiln's server gets (--ctx 8704 --max-batch 4)
    cmd = [str(w.bin / "llama-server"), "-m", str(gguf), "-ngl", "99", "-c", str(STREAMS * (a.prefill + 512)),
           "-np", str(STREAMS), "--host", "127.0.0.1", "--port", str(port), "--alias", "synth"] \
        + (["--n-cpu-moe", str(n_cpu_moe)] if n_cpu_moe else []) + (["--no-repack"] if a.no_repack else [])
    logf = open(log_path, "w")
    with GpuMemoryPeak() as mem:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=llama_env(w.bin), start_new_session=True)
        try:
            load_s = wait_ready(proc, base, log_path, "llama-server", limit_s=min(400, clock.left()))
            # which backends it loaded (libggml-cuda.so, a CPU variant): its log does not say at default verbosity
            maps = Path(f"/proc/{proc.pid}/maps").read_text().splitlines()
            backends = sorted({line.split()[-1] for line in maps if "/libggml-" in line and line.split()[-1].endswith(".so")})
            usage, timings = [], []
            res = measure(completions_client(base, "synth", usage, timings), vocab, a.steps, a.prefill, sampled)
            res["load_s"] = round(load_s, 1)
            res["streamed_usage_last"] = usage[-1] if usage else None
            res["streamed_usage_seen"] = len(usage)
            res["server_timings_last"] = timings[-1] if timings else None   # llama-server's own view of the 8k prefill
        finally:
            stop(proc)
            logf.close()
    res.update(mem.result())
    res["backends_loaded"] = backends
    res["command"] = " ".join(["llama-server", *cmd[1:]])
    return res


def phase_serve(w: Work, clock: Clock, res: dict, quant: str) -> None:
    gguf = ensure_q4(w, clock, res) if quant == "q4" else ensure_bf16(w, clock, res)
    lanes = ensure_lanes(w, gguf, res)
    vocab = w.cfg()["vocab_size"]
    runs = {}
    for name, n in configs_for(w, quant, gguf, res):
        if n and name != f"n_cpu_moe_{n}_budget" and not w.args.serve_extras:
            continue                                  # extras are llama-bench's; the server runs the budget's N
        try:
            need(clock, 30 if w.tiny else 120, f"llama-server {quant} {name}")
            # greedy all on the GPU (Kiln's resident run), sampled where experts live in host memory (its tiered run)
            r = llama_served(w, gguf, n, n > 0, vocab, w.dir / f"llama-server-{quant}-{name}.log", clock)
        except Skipped as e:
            runs[name] = {"skipped": str(e)}
            continue
        r.update({"n_cpu_moe": n, **lane_bound(res["token_bytes"][name], lanes)})
        if r.get("bound_tps"):
            r["fraction_of_bound"] = round(r["decode_tps"] / r["bound_tps"], 3)
        runs[name] = r
        log(f"llama-server {quant} {name}: decode {r['decode_tps']} tok/s, 4 streams {r['decode_tps_4_streams_aggregate']}, "
            f"TTFT {r['ttft_s_128_prompt']} s, 8k prefill {r['prefill_tps']} tok/s, peak {r.get('gpu_memory_peak_gib')} GiB, "
            f"backends {r['backends_loaded']}")
    res["llama_server"] = runs


# ------------------------------------------------------------------ report

# ------------------------------------------------------------------ main

def parse_extra(text: str) -> dict[str, list[int]]:
    """'bf16=7,q4=8' -> {'bf16': [7], 'q4': [8]}"""
    out: dict[str, list[int]] = {}
    for item in filter(None, text.split(",")):
        quant, _, n = item.partition("=")
        if quant not in QUANTS or not n.isdigit():
            raise SystemExit(f"--extra-n-cpu-moe: {item!r} is not QUANT=N with QUANT one of {', '.join(QUANTS)}")
        out.setdefault(quant, []).append(int(n))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", required=True, help=f"comma list of {', '.join(PHASES)}, or all")
    ap.add_argument("--work", default="/tmp/kiln-peer")
    ap.add_argument("--llama-bin", help="llama-bench, llama-quantize, llama-server and their libraries")
    ap.add_argument("--llama-src", help="llama.cpp's converter: conversion/, gguf-py/, models/ggml-vocab-qwen2.gguf")
    ap.add_argument("--out-dir", help="where each phase writes peer-<phase>.json")
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run: a 2-layer checkpoint, short prompts")
    ap.add_argument("--budget-s", type=float, default=540, help="this call's time: no step starts that would pass it")
    ap.add_argument("--no-repack", action="store_true",
                    help="llama.cpp's --repack 0 (CPU weight repacking off; --tiny sets it: this build's AMX repack of "
                         "Q4_K segfaults on the tiny shape's 256-wide rows)")
    ap.add_argument("--keep-store", action="store_true", help="keep Kiln's store after the conversion")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--bench-prompts", default=None, help="llama-bench -p (default 512,8192; tiny 64,256)")
    ap.add_argument("--bench-gen", type=int, default=None, help="llama-bench -n (default 128; tiny 16)")
    ap.add_argument("--steps", type=int, default=None, help="decode tokens per stream (default 96, h200_served's run; tiny 16)")
    ap.add_argument("--prefill", type=int, default=None, help="long-prompt tokens (default 8192; tiny 512)")
    ap.add_argument("--extra-n-cpu-moe", type=parse_extra, default={}, help="more llama-bench runs, e.g. bf16=7")
    ap.add_argument("--serve-extras", action="store_true", help="also serve the --extra-n-cpu-moe runs")
    ap.add_argument("--from", dest="from_", nargs="*", default=[], help="report: phase JSON files or folders")
    ap.add_argument("--kiln", nargs="*", default=[],
                    help="report: Kiln's served JSONs (bench/h200_served.py) to stand beside; a run in a later file wins")
    ap.add_argument("--out", help="report: the merged JSON")
    args = ap.parse_args()
    args.no_repack = args.no_repack or args.tiny
    args.bench_prompts = args.bench_prompts or ("64,256" if args.tiny else "512,8192")
    args.bench_gen = args.bench_gen or (16 if args.tiny else 128)
    args.steps = args.steps or (16 if args.tiny else 96)
    args.prefill = args.prefill or (512 if args.tiny else 8192)
    phases = list(PHASES) if args.phase == "all" else args.phase.split(",")
    if bad := [p for p in phases if p not in PHASES]:
        raise SystemExit(f"--phase: unknown {', '.join(bad)} (phases: {', '.join(PHASES)}, all)")
    device_phases = [p for p in phases if p != "report"]
    if device_phases and not (args.llama_bin and args.llama_src and args.out_dir):
        raise SystemExit(f"--phase {','.join(device_phases)} needs --llama-bin, --llama-src and --out-dir")
    clock = Clock(args.budget_s)
    w = Work(args) if device_phases else None
    runners = {"convert": phase_convert, "quantize": phase_quantize,
               "bench-bf16": lambda *a: phase_bench(*a, "bf16"), "bench-q4": lambda *a: phase_bench(*a, "q4"),
               "serve-bf16": lambda *a: phase_serve(*a, "bf16"), "serve-q4": lambda *a: phase_serve(*a, "q4")}
    failed = False
    for phase in device_phases:
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        res: dict = {"phase": phase, "tiny": args.tiny, "machine": {**machine(), "host": host_load()}}
        t0 = time.perf_counter()
        log(f"== {phase} (call at {clock.elapsed()} s of {args.budget_s:.0f})")
        try:
            runners[phase](w, clock, res)
        except Skipped as e:
            res["skipped"] = str(e)
            log(f"{phase}: skipped: {e}")
        except Exception as e:               # one phase failing must not lose the others' figures
            res["error"] = f"{type(e).__name__}: {str(e)[-3000:]}"
            failed = True
            log(f"{phase}: FAILED: {res['error']}")
        res["seconds"] = round(time.perf_counter() - t0, 1)
        write_result(out_dir / f"peer-{phase}.json", res)
        log(f"== {phase}: {res['seconds']} s; wrote {out_dir / f'peer-{phase}.json'}")
    if "report" in phases:
        if args.tiny and args.out_dir and not args.from_:
            args.from_ = [args.out_dir]
        out = report(args)
        if args.out:
            write_result(Path(args.out), out)
            log("wrote", args.out)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

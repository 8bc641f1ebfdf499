"""The one harness every bench entry point stands on: timing, interleaved rounds with the host load printed,
the machine and commit a figure was measured on, the result JSON (and its row in results/index.jsonl), a table.

Entry points run as modules from the repository root, so `engine`, `tool`, `bench` and `tests.fixtures` import
from this checkout with no sys.path edits:

    python -m bench.h200_served --help

A result worth keeping gets its row in results/index.jsonl:

    python -m bench.harness index bench/results/<file>.json decode_tps=609.1 prefill_8k_tps=31172

What each result file holds (bench/README.md): the command, commit, machine, conditions, rounds,
medians, peaks, the peer and the bound; `write_result` stamps the first three.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from tool.checks import hostload
from tool.checks.llama_cpp import free_port  # noqa: F401  (the entry points' one free-port finder)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
INDEX = RESULTS / "index.jsonl"
GIB = 1 << 30
PROMPT_LEN = 128              # the decode figures' prompt
STREAMS = 4                   # the aggregate figure's streams (engine.measure.peer sizes the budget's KV for as many)


def log(*a) -> None:
    print(*a, flush=True)


# ------------------------------------------------------------------ where and on what a figure was measured

def tree_commit(tree: Path = REPO) -> str:
    """Checkout `tree`'s short commit, "+dirty" when its working tree differs from it."""
    git = ["git", "-C", str(tree)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return commit + ("+dirty" if dirty else "")


def machine() -> dict:
    """GPU (name, driver, memory), CPU model and count, RAM: the machine line of a result file."""
    out = {"cpus": os.cpu_count(), "cpu": platform.processor() or None}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name":
                out["cpu"] = value
            elif key in ("cpu family", "model"):      # tells hosts apart where the name does not ("AMD EPYC")
                out["cpu_family" if key == "cpu family" else "cpu_model"] = int(value)
            elif not line.strip() and "cpu" in out:
                break
        mem = Path("/proc/meminfo").read_text().split()
        out["ram_gib"] = round(int(mem[mem.index("MemTotal:") + 1]) / (1 << 20), 1)
    except (OSError, ValueError):
        pass
    if shutil.which("nvidia-smi"):
        out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return out


def host_load() -> dict:
    """The host's load now: load averages and CPU pressure (tool check's own reading, so both judge alike)."""
    return hostload.public(hostload.snapshot())


# ------------------------------------------------------------------ timing and rounds

def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, fn's result)."""
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def median_spread(xs: list[float]) -> dict:
    """The median and the spread ((max - min) / median) of a side's rounds."""
    med = statistics.median(xs)
    return {"median": round(med, 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "spread": round((max(xs) - min(xs)) / med, 3) if med else None, "rounds": len(xs)}


def interleaved(sides: dict[str, Callable[[], dict]], rounds: int, warmup: bool = True) -> list[dict]:
    """Run each side once per round, sides alternating within a round, after one untimed warm-up of each; every
    round's figures come back beside the host load it ran under, which is printed as it goes."""
    if warmup:
        for fn in sides.values():
            fn()
    out = []
    for i in range(rounds):
        a = hostload.snapshot()
        row = {name: fn() for name, fn in sides.items()}
        b = hostload.snapshot()
        row["host"] = {**hostload.public(b), **hostload.between(a, b)}
        log(f"round {i + 1}/{rounds}: load {row['host']['loadavg']}, CPU pressure {row['host']['cpu_pressure_some']}")
        out.append(row)
    return out


# ------------------------------------------------------------------ result files and the index

def write_result(path: Path, doc: dict) -> Path:
    """Write a result JSON, stamped with the command, commit, machine and UTC date where it does not say them,
    through a temporary name and a rename (a killed run leaves no half file)."""
    doc = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "command": " ".join(["python", "-m", _module_name(), *sys.argv[1:]]),
           "commit": tree_commit(), "machine": machine(), **doc}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec and spec.name else sys.argv[0]


def index_row(path: Path, headline: dict, doc: dict | None = None) -> dict:
    """The results index's row for a kept result: date, commit, machine, command, headline figures, file."""
    doc = doc if doc is not None else json.loads(Path(path).read_text())
    m = doc.get("machine") or {}
    return {"date": str(doc.get("date", ""))[:10], "commit": doc.get("commit"),
            "machine": (m.get("nvidia_smi") or m.get("cpu")) if isinstance(m, dict) else m,
            "command": doc.get("command"), "headline": headline,
            "file": str(Path(path).resolve().relative_to(REPO / "bench"))}


def add_to_index(row: dict, index: Path = INDEX) -> None:
    """Put `row` in the index, replacing the row of the same file (one row per kept result)."""
    rows = [json.loads(line) for line in index.read_text().splitlines() if line.strip()] if index.exists() else []
    rows = [r for r in rows if r["file"] != row["file"]] + [row]
    tmp = index.with_name(index.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, index)


def table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of `rows` (missing cells blank), printed and returned."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in columns) + " |" for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def finish(res: dict, rows: list[dict], targets: dict, save, out: Path, seconds: float) -> int:
    """A device bench's end: the table and the verdicts into the JSON (saved), the table printed, the verdicts logged."""
    res["table"], res["targets"] = rows, targets
    save()
    if rows:
        table(rows, list(rows[0].keys()))
    log("targets:", json.dumps(targets))
    log("wrote", out, f"in {seconds} s")
    return 0


# ------------------------------------------------------------------ another checkout's engine beside this one

TREE_ENV = "KILN_BENCH_TREE"


def run_with_tree(tree: Path) -> str:
    """Measure checkout `tree`'s engine: this process re-runs itself with a folder holding only a link to `tree`'s
    engine/ ahead of this checkout on PYTHONPATH (the interpreter's search path, no sys.path edit), so `engine` comes
    from `tree` and the harness, `tool` and the test fixtures from here; its children inherit that. Call before
    anything imports `engine`. → `tree`'s commit."""
    tree = tree.resolve()
    if tree != REPO.resolve() and os.environ.get(TREE_ENV) != str(tree):
        shadow = Path(tempfile.mkdtemp(prefix="kiln-bench-tree-"))
        (shadow / "engine").symlink_to(tree / "engine", target_is_directory=True)
        env = {**os.environ, TREE_ENV: str(tree), "PYTHONPATH": os.pathsep.join(
            [str(shadow), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        # -P: `python -m` would put the working directory (usually this checkout) ahead of PYTHONPATH, and its
        # engine/ would shadow `tree`'s.
        os.execve(sys.executable, [sys.executable, "-P", "-m", _module_name(), *sys.argv[1:]], env)
    return tree_commit(tree)


@contextlib.contextmanager
def commit_tree(rev: str | None):
    """A detached `git worktree` of commit `rev` for the length of the block (None: no tree, yields None): the
    baseline a bench's `--before REV` measures beside this checkout, removed afterwards."""
    if rev is None:
        yield None
        return
    tmp = tempfile.mkdtemp(prefix="kiln-before-")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", tmp, rev], check=True, capture_output=True)
    try:
        yield Path(tmp)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", tmp], capture_output=True)


def parse_with_tree(ap) -> tuple:
    """ap's own options plus --tree, --rounds and --out, parsed; then run_with_tree(--tree) → (args, tree, commit)."""
    ap.add_argument("--tree", type=Path, default=REPO, help="the checkout whose engine is measured")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    return args, args.tree.resolve(), run_with_tree(args.tree)


# ------------------------------------------------------------------ a server driven through HTTP, streamed

def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    import torch        # function-level: keeps torch out of a CPU-only script's start-up until it needs ids
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def metrics(base: str) -> dict:
    import requests
    out = {}
    for line in requests.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("kiln_") and not line.startswith("#"):
            name, _, val = line.rpartition(" ")
            out[name] = float(val)
    return out


def wait_ready(proc: subprocess.Popen, base: str, log_path: Path, what: str, limit_s: float = 400) -> float:
    """Poll GET /health until 200 (engine serve and llama-server both answer it once loaded); seconds taken."""
    import requests
    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if requests.get(f"{base}/health", timeout=5).status_code == 200:
                return time.perf_counter() - t0
        except requests.RequestException:
            pass
        if time.perf_counter() - t0 > limit_s:
            raise RuntimeError(f"{what} did not become ready in {limit_s:.0f} s")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (started with start_new_session), SIGKILL after 30 s. A server that
    already exited (a refused model) is left as it is, so its own error is the one raised."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def completions_client(base: str, model: str, usage: list[dict], timings: list[dict] | None = None):
    """A make_stream over HTTP: streamed /v1/completions with token-id prompts and usage included, the same
    requests whichever server (Kiln's or llama-server). Each stream's token count is the server's own (its
    streamed usage); `timings` collects what a server reports about itself in its last chunk (llama-server does)."""
    import requests

    def make(prompt, n, temp, seed):
        body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": temp, "seed": seed,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        def gen(out):
            with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("usage"):
                        usage.append(ev["usage"])
                        out["tokens"] = ev["usage"]["completion_tokens"]     # the server's own count
                    if timings is not None and ev.get("timings"):
                        timings.append(ev["timings"])
                    if ev.get("choices") and ev["choices"][0].get("text"):
                        yield ev
        return gen
    return make


def run_stream(stream_fn, out: dict) -> None:
    """Consume one stream, stamping each item: out gets t_submit and stamps (and `tokens` where the stream
    reports its own count: the server's streamed usage)."""
    out["t_submit"] = time.perf_counter()
    stamps = []
    for _ in stream_fn(out):
        stamps.append(time.perf_counter())
    out["stamps"] = stamps


def summarize(runs: list[dict]) -> dict:
    """Streams' decode rate, aggregate over the window where all decode, and TTFT, from run_stream's stamps."""
    firsts = [r["stamps"][0] for r in runs]
    lasts = [r["stamps"][-1] for r in runs]
    n = [r.get("tokens", len(r["stamps"])) for r in runs]
    per = [(k - 1) / (b - a) for k, a, b in zip(n, firsts, lasts) if k > 1 and b > a]
    # Aggregate over the window where every stream decodes (prefills are admitted one per step, so the
    # streams start apart): items stamped inside it, scaled by tokens per item (the server may merge).
    lo, hi = max(firsts), min(lasts)
    inside = sum(sum(1 for t in r["stamps"] if lo < t <= hi) * (k / len(r["stamps"])) for r, k in zip(runs, n))
    return {"streams": len(runs), "tokens_per_stream": n,
            "decode_tps": round(sum(per) / len(per), 1),
            "aggregate_tps": round(inside / (hi - lo), 1) if hi > lo else None,
            "aggregate_tps_first_to_last": round(sum(k - 1 for k in n) / (max(lasts) - min(firsts)), 1),
            "ttft_s": round(sum(a - r["t_submit"] for a, r in zip(firsts, runs)) / len(runs), 4)}


def concurrent(fns) -> list[dict]:
    outs = [{} for _ in fns]
    ts = [threading.Thread(target=run_stream, args=(f, o)) for f, o in zip(fns, outs)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return outs


def measure(make_stream, vocab: int, steps: int, prefill: int, sampled: bool, counters=None) -> dict:
    """The same requests whichever side: make_stream(prompt, max_tokens, temperature, seed) -> iterator factory."""
    temp = 1.0 if sampled else 0.0
    res: dict = {"decoding": "sampled, temperature 1, seeded" if sampled else "greedy"}
    # warm: capture the graphs of batch 1 and 4 and the first KV buckets; Triton compiles
    concurrent([make_stream(prompt_ids(PROMPT_LEN, vocab, 100 + i), 16, temp, i) for i in range(STREAMS)])
    # (sampled: long enough that the tiers hold what this routing keeps coming back to, past the first touches)
    concurrent([make_stream(prompt_ids(PROMPT_LEN, vocab, 99), 320 if sampled else 64, temp, 9)])
    c0 = counters() if counters else None
    one = summarize(concurrent([make_stream(prompt_ids(PROMPT_LEN, vocab, 1), steps, temp, 1)]))
    c1 = counters() if counters else None
    four = summarize(concurrent([make_stream(prompt_ids(PROMPT_LEN, vocab, 10 + i), steps, temp, 10 + i)
                                 for i in range(STREAMS)]))
    # one long prompt first, untimed: its first use of the long-sequence kernels (flash attention at 8k, the
    # prefill GEMMs' shapes) is not the prefill rate (the runs before this warm-up measured that cold request)
    concurrent([make_stream(prompt_ids(prefill, vocab, 4), 2, temp, 4)])
    pre = summarize(concurrent([make_stream(prompt_ids(prefill, vocab, 3), 2, temp, 3)]))
    # a prompt of a length not seen before, as a user's is: kernels compiled, but every attention shape new
    fresh = prefill - 37
    new = summarize(concurrent([make_stream(prompt_ids(fresh, vocab, 6), 2, temp, 6)]))
    res.update({"decode_tps": one["decode_tps"], "ttft_s_128_prompt": one["ttft_s"], "steps": steps,
                "decode_tps_4_streams_aggregate": four["aggregate_tps"], "decode_tps_4_streams_each": four["decode_tps"],
                "decode_tps_4_streams_first_to_last": four["aggregate_tps_first_to_last"],
                "prefill_tokens": prefill, "prefill_ttft_s": pre["ttft_s"],
                "prefill_tps": round(prefill / pre["ttft_s"], 1), "prefill_new_length_tokens": fresh,
                "prefill_new_length_tps": round(fresh / new["ttft_s"], 1)})
    if counters:
        res["window_1_stream"] = {"before": c0, "after": c1, "tokens": one["tokens_per_stream"][0]}
    return res


# ------------------------------------------------------------------ the peer: llama.cpp

def gguf_convert(model_dir: Path, store: Path, llama_src: Path, out: Path, timeout_s: float | None = None) -> dict:
    """The checkpoint as GGUF bf16 through llama.cpp's own converter class (bench/gguf_from_store.py), its
    `conversion` and `gguf-py` packages found on the child's PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(llama_src), str(llama_src / "gguf-py"), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "bench.gguf_from_store", "--model", str(model_dir),
                        "--store", str(store), "--llama-src", str(llama_src), "--out", str(out)],
                       capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"GGUF conversion failed: {r.stderr[-3000:]}")
    return {"seconds": round(time.perf_counter() - t0, 1), "gguf_bytes": out.stat().st_size,
            "log_tail": r.stderr[-600:]}


def llama_bench_figures(rows: list[dict]) -> dict:
    """llama-bench's JSON rows -> decode tok/s (the -n test) and prefill tok/s per prompt length (the -p tests)."""
    out = {}
    for row in rows:
        if row.get("n_gen"):
            out["decode_tps"] = round(row["avg_ts"], 1)
            out["decode_tps_stdev"] = round(row.get("stddev_ts", 0), 1)
        else:
            out[f"prefill_tps_{row['n_prompt']}"] = round(row["avg_ts"], 1)
    return out


# ------------------------------------------------------------------ the bound's bandwidths, measured in the run

def dram_read_gbps(threads: int = 16) -> float:
    """Host memory read bandwidth with `threads` torch threads (a sum over 4 GiB of bf16)."""
    import torch        # function-level: the CPU scripts that never measure a lane start without it
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(2 * GIB, dtype=torch.bfloat16)
        a.sum()
        t0 = time.perf_counter()
        for _ in range(3):
            a.sum()
        return round(3 * a.numel() * 2 / (time.perf_counter() - t0) / 1e9, 2)
    finally:
        torch.set_num_threads(before)


def measure_lanes(store_file: Path, record_bytes: int, n_records: int) -> dict:
    """HBM copy, pinned host-to-device copy of whole records, O_DIRECT random record reads (1 and 16 threads) and
    one-thread DRAM copy, in GB/s: the lanes a token's bytes cross, measured on this machine now (CUDA only)."""
    import torch        # function-level, as above
    # engine, never at this module's top: run_with_tree must pick whose engine is imported before anything imports it
    from engine.measure.store_lane import record_read_rates

    dev = torch.device("cuda")
    out = {}
    a = torch.empty(2 * GIB // 2, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    out["hbm_gbps"] = 2 * 10 * a.numel() * 2 / (time.perf_counter() - t0) / 1e9   # read + write
    del a, b
    pieces = 64
    host = torch.empty(pieces * record_bytes, dtype=torch.uint8).pin_memory()
    host.random_(0, 255)
    gpu = torch.empty(pieces * record_bytes, dtype=torch.uint8, device=dev)
    for _ in range(2):
        gpu.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        for i in range(pieces):
            gpu[i * record_bytes:(i + 1) * record_bytes].copy_(host[i * record_bytes:(i + 1) * record_bytes],
                                                              non_blocking=True)
    torch.cuda.synchronize()
    out["pcie_h2d_pinned_gbps"] = 3 * pieces * record_bytes / (time.perf_counter() - t0) / 1e9
    del host, gpu
    # disk: random whole records, O_DIRECT, 1 and 16 threads (what the readers do), and the 16 threads' re-read
    out.update(record_read_rates(store_file, record_bytes, n_records))
    src = torch.empty(GIB, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    out["dram_copy_1t_gbps"] = 2 * 3 * GIB / (time.perf_counter() - t0) / 1e9
    torch.set_num_threads(os.cpu_count() or 1)
    return {k: round(v, 2) for k, v in out.items()}


def main(argv: list[str]) -> int:
    """`index RESULT.json NAME=VALUE...`: put RESULT's row, with these headline figures, in results/index.jsonl."""
    if len(argv) < 3 or argv[0] != "index" or not all("=" in a for a in argv[2:]):
        print("usage: python -m bench.harness index RESULT.json NAME=VALUE...", file=sys.stderr)
        return 2
    path = Path(argv[1]).resolve()
    if not path.is_file() or RESULTS not in path.parents:
        print(f"{argv[1]}: not a result file under {RESULTS}", file=sys.stderr)
        return 2
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"{argv[1]}: not JSON ({e})", file=sys.stderr)
        return 2
    headline = {}
    for item in argv[2:]:
        name, _, value = item.partition("=")
        try:
            headline[name] = json.loads(value)
        except ValueError:
            headline[name] = value
    add_to_index(index_row(path, headline, doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

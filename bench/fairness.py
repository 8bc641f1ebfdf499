"""Fairness and back-pressure of the served engine (issue 12, finding 5), through HTTP.

A real `engine serve` on 127.0.0.1 (this tree's, `python -m engine serve`), on a synthetic Qwen3-MoE
checkpoint written by transformers (tests/fixtures/tiny_models.py; hidden 256, 4 layers, 8 experts, so a
6k-token prompt takes seconds on this CPU), run twice in the same session:

  before   --chunk-size 8192 (a prompt is prefilled in one call, as the scheduler did before chunking)
           --max-queue 10000 (no admission limit, as before)
  after    --chunk-size CHUNK (default 512), --max-queue default (4 x --max-batch)

Scenario 1 — one 6k prefill arriving during 4 running streams: the longest gap between two streamed
events of a running stream while the prefill runs, beside the bound 2 x one prefill chunk's time. One
chunk's time is measured alone on the same server as TTFT(6k) - TTFT(6k - chunk): the prompt's LAST
chunk, the most expensive one (its attention reads the whole prompt). Every generated token is one
streamed event: the tokens that would show no text alone (special tokens, lone UTF-8 bytes) have their
lm_head rows zeroed in this synthetic checkpoint, so a gap between events is a gap between tokens.

Scenario 2 — 32 clients at once (each a 64-token prompt, 32 tokens out, streamed): time to first token
p50/p99 of the answered ones, and how many got 429 (with Retry-After).

    .venv/bin/python -m bench.fairness [--chunk 512] [--rounds 2] [--threads 1]

Both servers run --threads 1 by default: on this shared 2-core machine (load 9-13 while measured) a
2-thread OpenMP team waits a time slice at every parallel region (measured in-process, same model:
2 tok/s per stream and a 49 s 6k prefill with 2 threads, 28 tok/s and 8.3 s with 1), which would bury
the scheduling behaviour this measures under the machine's.

Writes bench/results/fairness.json. The load average is printed beside each figure: this CPU is shared.
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import click
import httpx

from bench.harness import write_result
from tests.fixtures.tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent

LONG = 6000
STREAMS = 4
CLIENTS = 32
MAX_BATCH = STREAMS + 1          # the 4 streams and the long prompt each hold a KV slot


def checkpoint(where: Path) -> Path:
    d = make_tiny_checkpoint("qwen3_moe", where, hidden=256, layers=4, experts=8)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192                 # room for the 6k prompt (the fixture says 4096)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    # One token, one SSE event: a random model also writes special tokens (shown as nothing) and lone UTF-8
    # bytes (held back until a character completes), which would merge two scheduler turns into one gap.
    # Their lm_head rows are zeroed (logit 0 while the rest spread around it: in practice never the argmax).
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    silent = [i for i in range(len(tok)) if i in special or not tok.decode([i]) or "\ufffd" in tok.decode([i])]
    (f,) = d.glob("*.safetensors")
    tensors = load_file(f)
    tensors["lm_head.weight"][silent] = 0.0
    save_file(tensors, f, metadata={"format": "pt"})
    return d


class Server:
    def __init__(self, model: Path, threads: int, *flags: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.p = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", "0",
                                   "--ctx", "8192", "--max-batch", str(MAX_BATCH), "--threads", str(threads), "--log-level",
                                   "warning", *flags],
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        line = self.p.stderr.readline()
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert m, line
        self.url = m.group(1)
        threading.Thread(target=self.p.stderr.read, daemon=True).start()    # drain its log
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while c.get("/health").status_code != 200:
                assert self.p.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)

    def close(self):
        self.p.terminate()
        self.p.wait(60)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [5 + (i * 7 + salt) % 370 for i in range(n)]


def ttft(url: str, ids: list[int]) -> float:
    with httpx.Client(base_url=url, timeout=600) as c:
        t0 = time.perf_counter()
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return time.perf_counter() - t0


def chunk_seconds(url: str, chunk: int, rounds: int) -> dict:
    """TTFT of the 6k prompt alone, and of it less its last chunk: their difference is one chunk's time."""
    whole, less = [], []
    for r in range(rounds):                                # interleaved; fresh prompts (no cache to help)
        whole.append(ttft(url, prompt(LONG, 100 + r)))
        less.append(ttft(url, prompt(LONG - chunk, 200 + r)) if chunk < LONG else 0.0)
    return {"ttft_6k_s": statistics.median(whole), "ttft_less_one_chunk_s": statistics.median(less),
            "chunk_s": statistics.median(whole) - statistics.median(less)}


def running_streams_gap(url: str) -> dict:
    """Longest gap between events of a running stream while a 6k prompt is prefilled beside them."""
    stamps: list[list[float]] = [[] for _ in range(STREAMS)]
    stop = threading.Event()

    def stream(i):
        body = {"prompt": prompt(16, i), "max_tokens": 8000 - 16, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(base_url=url, timeout=600) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps[i].append(time.perf_counter())
                if stop.is_set():
                    return
    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    while min(len(s) for s in stamps) < 20:                # all four running
        time.sleep(0.05)
    before = [len(s) for s in stamps]
    time.sleep(1.0)
    step = 1.0 / statistics.median([(len(s) - b) for s, b in zip(stamps, before)] or [1])   # s per event, alone
    t0 = time.perf_counter()
    ttft_beside = ttft(url, prompt(LONG, 300))
    t1 = time.perf_counter()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(60)
    gaps = []
    for s in stamps:
        inside = [x for x in s if t0 <= x <= t1 + 0.5]
        edge = [x for x in s if x < t0][-1:]                # the last event before the prompt arrived
        seq = edge + inside
        gaps.append(max((b - a for a, b in zip(seq, seq[1:])), default=t1 - t0))
    return {"longest_gap_s": max(gaps), "gap_per_stream_s": gaps, "ttft_6k_beside_streams_s": ttft_beside,
            "event_interval_alone_s": step}


def many_clients(url: str) -> dict:
    results: list = [None] * CLIENTS
    go = threading.Barrier(CLIENTS)

    def client(i):
        body = {"prompt": prompt(64, 1000 + i), "max_tokens": 32, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(base_url=url, timeout=900) as c:
            go.wait()
            t0 = time.perf_counter()
            with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code == 429:
                    results[i] = ("429", r.headers.get("retry-after"))
                    return
                assert r.status_code == 200, r.read()
                first = None
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - t0
                results[i] = ("ok", first, time.perf_counter() - t0)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    wall = time.perf_counter() - t0
    ok = sorted(r[1] for r in results if r and r[0] == "ok")
    refused = [r for r in results if r and r[0] == "429"]
    q = statistics.quantiles(ok, n=100, method="inclusive") if len(ok) > 1 else ok * 99
    return {"answered": len(ok), "refused_429": len(refused),
            "retry_after_s": sorted({int(r[1]) for r in refused if r[1]}), "ttft_p50_s": statistics.median(ok),
            "ttft_p99_s": q[98], "ttft_max_s": ok[-1], "wall_s": wall}


@click.command()
@click.option("--chunk", default=512, show_default=True, help="--chunk-size of the 'after' server.")
@click.option("--rounds", default=2, show_default=True, help="Rounds of the chunk-time measurement (median).")
@click.option("--threads", default=1, show_default=True, help="The servers' --threads (see above).")
@click.option("--out", default=str(ROOT / "bench" / "results" / "fairness.json"), show_default=True)
def main(chunk, rounds, threads, out):
    work = Path(tempfile.mkdtemp(prefix="kiln-fairness-"))
    model = checkpoint(work / "model")
    configs = {"before": ["--chunk-size", "8192", "--max-queue", "10000"], "after": ["--chunk-size", str(chunk)]}
    runs = {}
    for name, flags in configs.items():
        s = Server(model, threads, *flags)
        try:
            c = chunk if name == "after" else LONG
            print(f"[{name}] chunk time … load {os.getloadavg()[0]:.1f}", flush=True)
            ch = chunk_seconds(s.url, c, rounds)
            print(f"[{name}] 6k prefill beside {STREAMS} streams … load {os.getloadavg()[0]:.1f}", flush=True)
            gap = running_streams_gap(s.url)
            print(f"[{name}] {CLIENTS} clients … load {os.getloadavg()[0]:.1f}", flush=True)
            load = many_clients(s.url)
            runs[name] = {"flags": flags, "chunk_tokens": c, **ch, **gap, "bound_2x_chunk_s": 2 * ch["chunk_s"],
                          "within_bound": gap["longest_gap_s"] < 2 * ch["chunk_s"], "clients": load,
                          "loadavg_1m": os.getloadavg()[0]}
        finally:
            s.close()
    result = {"date": date.today().isoformat(), "host": platform.node(), "cpu_count": os.cpu_count(),
              "command": f".venv/bin/python -m bench.fairness --chunk {chunk} --rounds {rounds} --threads {threads}",
              "threads": threads,
              "model": "tiny_models qwen3_moe hidden 256, 4 layers, 8 experts top-2, fp32, CPU",
              "long_prompt_tokens": LONG, "running_streams": STREAMS, "max_batch": MAX_BATCH, "clients": CLIENTS,
              "runs": runs}
    write_result(Path(out), result)
    print(f"\n| run | chunk | one chunk s | longest gap s | 2x chunk s | within | 6k TTFT alone s | "
          f"{CLIENTS} clients: TTFT p50 / p99 s | 429s | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        cl = r["clients"]
        print(f"| {name} | {r['chunk_tokens']} | {r['chunk_s']:.2f} | {r['longest_gap_s']:.2f} | "
              f"{r['bound_2x_chunk_s']:.2f} | {'yes' if r['within_bound'] else 'no'} | {r['ttft_6k_s']:.2f} | "
              f"{cl['ttft_p50_s']:.2f} / {cl['ttft_p99_s']:.2f} | {cl['refused_429']} | {r['loadavg_1m']:.1f} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

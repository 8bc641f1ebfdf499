"""Decode speed on this CPU: the engine against transformers' own `generate` on the same checkpoint,
in the same run, with a memory-bandwidth bound beside them.

For each architecture a small random checkpoint is written by transformers' save_pretrained
(tests/fixtures/tiny_models.py, bigger than the test ones), then for one greedy stream:
  transformers  model.generate(max_new_tokens=N) minus a max_new_tokens=1 run (its prefill)
  engine        LLM.stream — the server's path, scheduler thread included — first token to last
Both use fp32; transformers runs on torch's default threads, the engine on --threads (default 1, see
the option); runs are interleaved and each figure is the median of --repeats runs. The engine's
tokens must equal transformers' (greedy), or the run fails. A batch row shows the engine's
aggregate rate with --batch streams at once. The bound: bytes a token must read (non-expert
weights + top_k experts per MoE layer) at the measured copy bandwidth — one stream's roofline, not a target
(a batch shares weight reads, so its aggregate may pass it).

    .venv/bin/python bench/engine_cpu_decode.py [--tokens 64] [--hidden 512] [--layers 4] [--experts 16] [--threads N]
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
from engine.kernels.cpu import set_compute_threads
from engine.llm import LLM, SamplingParams
from engine.dense_weights import Projection
from tests.fixtures.tiny_models import make_tiny_checkpoint

ARCHS = ("qwen3_moe", "glm4_moe", "mixtral")


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of a large tensor copy (read + write counted), the best of 5."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def bytes_per_token(llm: LLM) -> int:
    """Bytes one decode step reads: one embedding row, every projection the model holds (lm_head's own copy
    on the CPU even when tied), the norms, and top_k expert records per MoE layer."""
    m, cfg = llm.model, llm.model.cfg
    seen, total = set(), m.embed.shape[1] * m.embed.element_size()
    for t in [m.norm, *_tensors(m.head)] + [v for layer in m.layers for v in _tensors(layer)]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total + len(cfg.moe_layers) * cfg.top_k * m.provider.layout.payload_bytes


def _tensors(obj):
    """The tensors a module (or a Projection) holds, its children's included."""
    if isinstance(obj, Projection):
        yield from (t for t in (obj.weight, obj.bias) if t is not None)
        return
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, Projection):
            yield from _tensors(v)
    for child in obj.children():
        yield from _tensors(child)


def hf_decode(model, prompt: list[int], n: int, threads: int) -> tuple[float, list[int]]:
    torch.set_num_threads(threads)
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, **kw)
        t2 = time.perf_counter()
    # Decode time = the n-token run less the 1-token run (prefill + first token).
    return (n - 1) / ((t2 - t1) - (t1 - t0)), out[0, len(prompt):].tolist()


def engine_decode(llm: LLM, prompt: list[int], n: int, threads: int) -> tuple[float, list[int]]:
    set_compute_threads(threads)
    stamps, toks = [], []
    for t in llm.stream(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        stamps.append(time.perf_counter())
        toks.append(t.id)
    return (n - 1) / (stamps[-1] - stamps[0]), toks


def engine_batch(llm: LLM, prompt: list[int], n: int, streams: int) -> float:
    done = []

    def one(i):
        done.append(len(llm.generate(prompt[: len(prompt) - i], SamplingParams(max_tokens=n, ignore_eos=True))))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


@click.command()
@click.option("--tokens", default=64, show_default=True, help="Tokens generated per run.")
@click.option("--hidden", default=512, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--experts", default=16, show_default=True)
@click.option("--top-k", default=2, show_default=True)
@click.option("--batch", default=4, show_default=True, help="Concurrent streams for the engine's batch row.")
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Engine compute threads; transformers keeps torch's default. 1 here: these small models sit in "
                   "cache, so a decode is bound by op overhead, not memory, and a second thread only adds hand-offs "
                   "(measured 160 vs 197-240 tok/s); the 2-thread default pays off on DRAM-bound models "
                   "(bench/smollm2_demo_speed.py).")
@click.option("--arch", "archs", multiple=True, type=click.Choice(ARCHS), default=ARCHS)
@click.option("--out", type=click.Path(dir_okay=False), default=str(ROOT / "bench/results/engine_cpu_decode.json"),
              show_default=True)
def main(tokens, hidden, layers, experts, top_k, batch, repeats, threads, archs, out):
    from transformers import AutoModelForCausalLM

    hf_threads = torch.get_num_threads()

    console = Console()
    bandwidth = copy_bandwidth()
    prompt = [5, 17, 200, 42, 99, 7, 311, 64, 128, 3, 250, 19, 77, 31, 150, 2]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            ckpt = make_tiny_checkpoint(arch, Path(tmp) / arch, layers=layers, experts=experts, top_k=top_k,
                                        hidden=hidden)
            ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
            ref.generation_config.eos_token_id = None
            hf, eng = [], []
            with LLM.load(ckpt, dtype="float32", max_context=256, max_batch=batch, threads=threads) as llm:
                engine_decode(llm, prompt, 8, threads)          # warm-up
                for _ in range(repeats):                        # interleaved: a busy machine slows both alike
                    hf.append(hf_decode(ref, prompt, tokens, hf_threads))
                    eng.append(engine_decode(llm, prompt, tokens, threads))
                agg = statistics.median(engine_batch(llm, prompt, tokens, batch) for _ in range(repeats))
                bound = bandwidth / bytes_per_token(llm)
            if eng[0][1] != hf[0][1]:
                raise SystemExit(f"{arch}: engine tokens differ from transformers' greedy tokens")
            hf_rate = statistics.median(r for r, _ in hf)
            eng_rate = statistics.median(r for r, _ in eng)
            rows.append(dict(arch=arch, transformers_tok_s=round(hf_rate, 1), engine_tok_s=round(eng_rate, 1),
                             speedup=round(eng_rate / hf_rate, 2), engine_batch_tok_s=round(agg, 1),
                             bound_tok_s=round(bound, 1), tokens_identical=True))
            del ref

    table = Table(title=f"CPU decode, fp32, 1 stream, {tokens} tokens (median of {repeats}); "
                        f"hidden {hidden}, {layers} layers, {experts} experts, top-{top_k}")
    for col in ("arch", "transformers tok/s", "engine tok/s", "speedup", f"engine ×{batch} streams tok/s",
                "bandwidth bound tok/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["arch"], f"{r['transformers_tok_s']:.1f}", f"{r['engine_tok_s']:.1f}", f"{r['speedup']:.2f}×",
                      f"{r['engine_batch_tok_s']:.1f}", f"{r['bound_tok_s']:.0f}")
    console.print(table)
    console.print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; engine threads {threads}, transformers threads {hf_threads}")

    result = dict(bench="engine_cpu_decode", date=date.today().isoformat(), machine=platform.machine(),
                  processor=platform.processor() or platform.uname().machine, torch=torch.__version__,
                  threads=threads, transformers_threads=hf_threads, copy_gb_s=round(bandwidth / 1e9, 2),
                  shape=dict(hidden=hidden, layers=layers, experts=experts, top_k=top_k), tokens=tokens,
                  repeats=repeats, batch_streams=batch, rows=rows,
                  engine_faster=all(r["speedup"] > 1 for r in rows))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp_out = Path(out).with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    tmp_out.replace(out)
    console.print(f"wrote {out}")
    if not result["engine_faster"]:
        raise SystemExit("the engine is not faster than transformers on every architecture")


if __name__ == "__main__":
    main()

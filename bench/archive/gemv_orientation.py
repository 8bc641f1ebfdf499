"""Why the CPU engine holds its weights transposed: one-row GEMV bandwidth by weight orientation.

A decode step on the CPU is a chain of one-row GEMVs over weights much larger than the caches, so it
runs at the rate torch's BLAS streams a weight. Measured on the demo's shapes, in one run:
  rows   the checkpoint's [out, in]  (x @ W.t(): a dot product per output)
  cols   transposed [in, out]         (x @ W^T: the engine's cols store order, engine.dense_weights.Projection)
each alone (one GEMV), as two halves in one batched matmul (two threads, one half each) and, for the
experts, as a pair of experts in one batched matmul (what the engine does in a decode step);
beside the bound: a plain read of the same bytes (torch.sum) on the same threads.
Weights cycle through 64 distinct copies (~450 MB for the expert shape) so no cache holds them.

    .venv/bin/python bench/gemv_orientation.py [--threads 2] [--out bench/results/gemv_orientation.json]
"""
from __future__ import annotations

import json
import os
import platform
import time
from datetime import date
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {  # name -> (out, in) as the checkpoint holds it
    "expert gate|up 3072x576": (3072, 576),
    "expert down 576x1536": (576, 1536),
    "lm_head 49152x576": (49152, 576),
}


def rate(fn, nbytes: int, repeats: int) -> float:
    """GB/s of the best of `repeats` passes (each pass touches every copy once)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def measure(out: int, inp: int, copies: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(out)
    rows = [torch.randn(out, inp, generator=g) for _ in range(copies)]
    cols = [w.t().contiguous() for w in rows]
    x = torch.randn(1, inp, generator=g)
    x2 = x.reshape(1, 1, inp).expand(2, 1, inp)
    nbytes = copies * out * inp * 4
    figures = {
        "read bound (sum)": rate(lambda: [w.sum() for w in rows], nbytes, repeats),
        "rows, one GEMV": rate(lambda: [torch.mm(x, w.t()) for w in rows], nbytes, repeats),
        "rows, two halves": rate(lambda: [torch.bmm(x2, w.view(2, out // 2, inp).transpose(1, 2)) for w in rows],
                                 nbytes, repeats),
        "cols, one GEMV": rate(lambda: [torch.mm(x, w) for w in cols], nbytes, repeats),
        "cols, two halves": rate(lambda: [torch.bmm(x2, w.view(inp, 2, out // 2).transpose(0, 1)) for w in cols],
                                 nbytes, repeats),
    }
    pairs_rows = [torch.stack(rows[i:i + 2]) for i in range(0, copies, 2)]
    pairs_cols = [torch.stack(cols[i:i + 2]) for i in range(0, copies, 2)]
    figures["rows, pair of experts"] = rate(lambda: [torch.bmm(x2, p.transpose(1, 2)) for p in pairs_rows], nbytes, repeats)
    figures["cols, pair of experts"] = rate(lambda: [torch.bmm(x2, p) for p in pairs_cols], nbytes, repeats)
    return {k: round(v, 2) for k, v in figures.items()}


@click.command()
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--copies", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=str(ROOT / "bench/results/gemv_orientation.json"),
              show_default=True)
def main(threads, copies, repeats, out):
    torch.set_num_threads(threads)
    console = Console(width=150)
    results = {}
    for name, (o, i) in SHAPES.items():
        n = copies if o * i * 4 * copies < 4 << 30 else max(2, (1 << 30) // (o * i * 4) // 2 * 2)
        results[name] = measure(o, i, n, repeats)
    cols = list(next(iter(results.values())))
    table = Table(title=f"one-row GEMV, GB/s of weight streamed, fp32, {threads} threads (best of {repeats})")
    table.add_column("weight")
    for c in cols:
        table.add_column(c, justify="right")
    for name, r in results.items():
        table.add_row(name, *(f"{r[c]:.1f}" for c in cols))
    console.print(table)
    doc = dict(bench="gemv_orientation", date=date.today().isoformat(), machine=platform.machine(),
               cpus=len(os.sched_getaffinity(0)), threads=threads, torch=torch.__version__,
               command=f"bench/gemv_orientation.py --threads {threads} --copies {copies} --repeats {repeats}",
               gb_per_s=results)
    tmp = Path(out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()

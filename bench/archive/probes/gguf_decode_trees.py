"""Probe (issue 29, branch ggufdecode): one-token decode steps of a GGUF served alone, in-process, for two checkouts
of the engine, rounds alternating (a subprocess a round: load, prefill 8 tokens, 8 warm-up steps, then 128 greedy
steps timed). What the one-call GGUF step, the fused q|k|v / gate|up regions, F16C scales and the vocabulary's
BlockProjection buy over the tree before them, on the same file and host load; not a served figure (no HTTP, no
store: InMemoryExperts) and not a verdict (bench.quant_demo_speed's rounds are).

    python -m bench.archive.probes.gguf_decode_trees --gguf Q4_K_M.gguf --tree base=/tmp/base --tree new=. \
        --rounds 6 --threads 1 --out bench/archive/results/<date>-gguf-decode-trees.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench import harness

STEPS = r"""
import sys, time, torch
from engine.loader import load_model
torch.set_num_threads(int(sys.argv[2]))
m = load_model(sys.argv[1], device="cpu", max_context=512, max_batch=1)
with torch.inference_mode():
    tok = int(m.prefill([1, 2, 3, 4, 5, 6, 7, 8], 0).argmax())
    for i in range(8):
        tok = int(m.decode_step([tok], [0], [8 + i])[0].argmax())
    t0 = time.perf_counter()
    for i in range(128):
        tok = int(m.decode_step([tok], [0], [16 + i])[0].argmax())
    print(128 / (time.perf_counter() - t0))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tree", action="append", required=True, help="NAME=DIR, twice")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree)
    rows = []
    for r in range(args.rounds):
        row = {}
        for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            # the engine's own OpenMP setting (engine.cli sets it before torch loads)
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()), "GOMP_SPINCOUNT": "1000"}
            out = subprocess.run([sys.executable, "-c", STEPS, args.gguf, str(args.threads)], cwd=tree, env=env,
                                 capture_output=True, text=True, check=True)
            row[name] = round(float(out.stdout.split()[-1]), 2)
        row["host"] = harness.host_load()
        harness.log(f"round {r + 1}/{args.rounds}: {row}")
        rows.append(row)
    med = {n: harness.median_spread([row[n] for row in rows]) for n in trees}
    harness.log(med)
    harness.write_result(Path(args.out), {"gguf": args.gguf, "threads": args.threads,
                                          "trees": {n: harness.tree_commit(Path(t)) if (Path(t) / ".git").exists()
                                                    else t for n, t in trees.items()},
                                          "rounds": rows, "medians": med})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What one token's draw costs, per sampler mode, on this machine's CPU: the engine's own `engine.sampling.choose`
over one row of logits (the CPU demo's decode draws one row a step), greedy beside
temperature 1 and the truncating settings chat clients send (top-p 0.9, top-k 40, min-p 0.05), rounds interleaved,
medians, the host load printed. `--before REV` times an earlier tree's sampler in the same rounds (its
engine/sampling.py imported from a `git worktree` of REV), so a change is measured against its baseline in one run.

  python -m bench.sampler_speed --vocab 49152 --out bench/results/<date>-sampler-speed.json [--before REV]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import commit_tree, host_load, log, write_result

REPO = Path(__file__).resolve().parent.parent
MODES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "t 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "t 0.8, top-k 40": dict(temperature=0.8, top_k=40),
    "t 1, min-p 0.05": dict(temperature=1.0, min_p=0.05),
    "t 0.6, top-p 0.95, top-k 20": dict(temperature=0.6, top_p=0.95, top_k=20),
}


def sampler_of(tree: Path):
    """engine.sampling as `tree` has it, imported under another name (what it imports of the engine comes from this
    tree: the CPU's draw uses none of it)."""
    if tree == REPO:
        import engine.sampling
        return engine.sampling
    name = f"kiln_sampling_{abs(hash(str(tree)))}"
    spec = importlib.util.spec_from_file_location(name, tree / "engine/sampling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod                # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def time_draws(sampling, x: torch.Tensor, spec: dict, draws: int) -> float:
    """Median µs of one choose() over `draws` tokens (each a new draw index), after a warm-up."""
    for i in range(5):
        sampling.choose(x, [sampling.RowSpec(seed=1, index=i, **spec)])
    times = []
    for i in range(draws):
        row = sampling.RowSpec(seed=1, index=100 + i, **spec)
        t0 = time.perf_counter()
        sampling.choose(x, [row])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=49152, help="logits a row (SmolLM2's 49,152; Qwen's 151,936)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--draws", type=int, default=200, help="tokens timed a round and mode")
    ap.add_argument("--threads", type=int, default=2, help="torch's CPU threads (the demo's)")
    ap.add_argument("--before", default=None, help="an earlier commit whose sampler is timed beside this tree's")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    with commit_tree(a.before) as before:
        trees = {"now": REPO, **({f"before ({a.before})": before} if before else {})}
        samplers = {k: sampler_of(t) for k, t in trees.items()}
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, a.vocab, generator=gen) * 3          # a model's logits: a few dominant, a long tail
        rounds = []
        for r in range(a.rounds):
            row = {"round": r + 1, "load": host_load()["loadavg"]}
            for mode, spec in MODES.items():
                for name, s in samplers.items():             # sides interleaved within each round
                    row[f"{name} | {mode}"] = round(time_draws(s, x, spec, a.draws), 1)
            rounds.append(row)
            log(f"round {r + 1}: load {row['load']}")
    med = {k: round(statistics.median(rr[k] for rr in rounds), 1) for k in rounds[0] if "|" in k}
    lines = ["| mode | " + " | ".join(f"{n} µs" for n in samplers) + (" | now / before |" if a.before else " |"),
             "|---|" + "---:|" * (len(samplers) + (1 if a.before else 0))]
    for mode in MODES:
        vals = [med[f"{n} | {mode}"] for n in samplers]
        ratio = f" | {vals[0] / vals[1]:.3f} |" if a.before else " |"
        lines.append(f"| {mode} | " + " | ".join(f"{v:,.1f}" for v in vals) + ratio)
    table = "\n".join(lines)
    print(table)
    write_result(a.out, {"bench": "sampler_speed", "vocab": a.vocab, "threads": a.threads, "rounds": rounds,
                         "medians_us": med, "modes": MODES, "before": a.before, "table": table,
                         "device": "cpu", "host_load_end": host_load()})
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which share of decode's expert picks the GPU slots serve, under the bench's routings: the tiers' own host logic
(zero-copy decode's promotions and write-backs, the planner, a prefill's waves through the slots) driven on the CPU.

What runs is the engine's code, not a model of it: a TieredExperts over a synthesized store with Qwen3-30B-A3B's
routing shape (128 experts, top-8; a small hidden size, since only where records lie is measured), its tiers
preloaded, zero-copy decode on (the slot tier in host memory, as CPU CI runs it). Each decode step writes the step's
picks, drawn by engine.routing_trace.BenchRouting, into the routing log a GPU step's kernels would write, and calls
the provider's after-launch hook, which reads it, plans, promotes and writes back. A prefill is TieredExperts.forward
on a batch of drawn picks, the path an 8k prompt takes. The GPU's kernels and copy stream are not involved, so the
shares are exact and the run is deterministic; what each share is worth in tokens a second is the GPU bench's
(bench/h200_offload.py).

The slots are the 6 GiB budget's share of bench/h200_offload.py on the H100 (254 of 1,024 records, 8 layers), the
promotion budget the one those runs reached (16 a step, MAX_MOVES). `--before REV` runs an earlier tree's engine in a
child beside this one's.

  python -m bench.placement_sim --out bench/results/<date>-placement-sim.json [--before REV]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import REPO, commit_tree, log, table, tree_commit, write_result

ROUTINGS = ("calibrated", "uniform")
EXPERTS, TOP_K = 128, 8


def measure(work: Path, layers: int, gpu_slots: int, warm: int, prefill: int, steps: int, seed: int) -> list[dict]:
    """This process's engine (run_with_tree picks which): one row per routing."""
    os.environ.setdefault("TRITON_INTERPRET", "1")      # the slot kernels' check; no kernel runs here
    import numpy as np
    import torch
    from engine.routing_trace import BenchRouting
    from engine.store import manifest as mf
    from engine.synth import synthesize
    from engine.tiers.tiered import TieredExperts
    store = work / f"store-{layers}"
    if not store.exists():
        synthesize(work / f"model-{layers}", store, device="cpu", num_hidden_layers=layers, hidden_size=64,
                   num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=64, intermediate_size=64,
                   vocab_size=256)
    m = mf.load(store)
    rows = []
    for routing in ROUTINGS:
        prov = TieredExperts(m, store, device="cpu", gpu_slots=gpu_slots, ram_slots=len(m.records) - gpu_slots + 64,
                             readers=2)
        try:
            prov.preload()
            prov.use_zero_copy("on")
            zc = prov.zero_copy
            zc.budget = lambda: 16
            br = BenchRouting(routing, EXPERTS, TOP_K, list(m.moe_layers), seed=seed)

            def step():
                for layer in m.moe_layers:
                    ids = br(layer, torch.zeros(1, TOP_K, dtype=torch.int64))
                    zc.log[zc.rows[layer], :TOP_K] = ids.reshape(-1).to(torch.int32)
                prov.after_decode_launch(TOP_K)

            def window(n):
                g0, r0, p0 = zc.picks["gpu"], zc.picks["ram"], zc.promotions
                for _ in range(n):
                    step()
                g, r = zc.picks["gpu"] - g0, zc.picks["ram"] - r0
                return round(g / max(1, g + r), 4), round((zc.promotions - p0) / n, 2)

            for _ in range(warm):
                step()
            row = {"routing": routing, "warm_steps": warm, "before_prefill": window(128)[0]}
            if prefill:
                with torch.inference_mode():
                    g = torch.Generator().manual_seed(seed)
                    for layer in m.moe_layers:
                        ids = br(layer, torch.zeros(prefill, TOP_K, dtype=torch.int64))
                        prov.forward(layer, torch.randn(prefill, 64, generator=g), ids,
                                     torch.full((prefill, TOP_K), 1.0 / TOP_K))
            row["first_32"], _ = window(32)
            row["next_96"], _ = window(96)
            row["steady"], row["promotions_per_step"] = window(steps)
            row["gpu_experts_by_layer"] = [sum(1 for k in prov.gpu.cache.resident() if k.layer == layer)
                                           for layer in m.moe_layers]
            if routing == "calibrated":           # what the hottest records by the pools' own counts would serve
                cnt = np.zeros((len(m.moe_layers), EXPERTS))
                for i, layer in enumerate(m.moe_layers):
                    np.add.at(cnt[i], br.pool[layer].reshape(-1).numpy(), 1)
                row["best_static"] = round(float(np.sort(cnt.ravel())[::-1][:gpu_slots].sum() / cnt.sum()), 4)
            else:
                row["best_static"] = round(gpu_slots / len(m.records), 4)
            rows.append(row)
        finally:
            prov.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kiln-placement-sim")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gpu-slots", type=int, default=254)
    ap.add_argument("--warm", type=int, default=600, help="decode steps before the measured windows")
    ap.add_argument("--prefill", type=int, default=1024, help="tokens of the prefill after the warm steps (0: none)")
    ap.add_argument("--steps", type=int, default=512, help="decode steps of the steady window")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--before", default=None, help="an earlier commit whose engine runs beside this tree's")
    ap.add_argument("--tree", type=Path, default=None, help=argparse.SUPPRESS)     # the child's engine
    a = ap.parse_args(argv)
    knobs = dict(layers=a.layers, gpu_slots=a.gpu_slots, warm=a.warm, prefill=a.prefill, steps=a.steps, seed=a.seed)
    if a.tree is not None:                       # the child: measure, print JSON
        from bench.harness import run_with_tree
        run_with_tree(a.tree)
        a.work.mkdir(parents=True, exist_ok=True)
        print(json.dumps(measure(a.work, **knobs)))
        return 0
    with commit_tree(a.before) as before:
        trees = {"now": REPO, **({f"before ({a.before})": before} if before else {})}
        results = {}
        for name, tree in trees.items():
            cmd = [sys.executable, "-m", "bench.placement_sim", "--tree", str(tree), "--work", str(a.work),
                   *[f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]]
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise SystemExit(f"placement_sim: the {name} tree failed: {r.stderr.strip().splitlines()[-1:]}")
            results[name] = {"commit": tree_commit(tree), "rows": json.loads(r.stdout.strip().splitlines()[-1])}
            log(f"{name}: done")
    flat = [{"tree": name, **row} for name, res in results.items() for row in res["rows"]]
    cols = ["tree", "routing", "before_prefill", "first_32", "next_96", "steady", "best_static", "promotions_per_step"]
    text = table(flat, cols)
    if a.out:
        write_result(a.out, {"bench": "placement_sim", "knobs": knobs, "results": results,
                             "columns": {"before_prefill": "share of decode picks served from GPU slots, the 128 steps "
                                         "before the prefill", "first_32": "the 32 steps after it",
                                         "next_96": "the 96 after those", "steady": f"the {a.steps} after those",
                                         "best_static": "the hottest records by the routing pools' own counts "
                                         "(uniform: the slots' share of records)"},
                             "table": text})
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

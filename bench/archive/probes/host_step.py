"""The tiered decode's host step per MoE layer, timed on this CPU: the Python a GPU waits for at every layer.

On the H200 the tiered decode at a 24 GB budget spent (1/166.1 - 1/514.6) / 24 = 0.17 ms a layer beyond the resident
step (bench/README.md, fourth session): the routing read, then TieredExperts._place deciding the copies and filling
the slot table. This probe runs that same code on a CPU "device" given slots (engine/tiers/gpu.py: the slot tier in
host memory, where a read of the routing costs nothing), at the H200 run's tier sizes and routing shape — 24 MoE
layers x 128 experts, top-8, 2,149 slot-tier + 1,820 RAM slots over 3,072 records, preloaded, layer-ahead prediction
on — with small records (hidden 256) so that the step's arithmetic is small beside its host work. It decodes real
tokens greedily through the model and reads TieredExperts.host_seconds (the time inside _place) per layer.

    .venv/bin/python bench/probes/host_step.py [--tree DIR] [--tokens 96] [--rounds 5] [--out results/host_step.json]

--tree: another checkout's engine, to compare a change against its base in one run: each round is a fresh
process per tree, rounds alternate between the trees, medians reported.

--zero-copy: the host work of zero-copy decode instead (engine/tiers/zero_copy.py: no host step inside a step, but
after each launch the host reads the previous step's routing log, counts, promotes and updates the record table —
the Python the server's event loop waits for under the GIL). No kernel runs: the routing the model's router gave in
a piecewise decode of the same tokens (recorded with TieredExperts' trace) is written into the routing log step by
step, and TieredExperts.before_decode / after_decode_launch run as MoEModel.decode_step runs them; reported per step
and per MoE layer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

from bench.harness import tree_commit

SHAPE = {"layers": 24, "hidden": 256, "experts": 128, "top_k": 8, "moe_intermediate": 64, "vocab": 2048}
SLOTS = {"gpu": 2149, "ram": 1820}

ROUND = r"""
import json, sys, time, torch
from engine.loader import load_model
from engine.models.common import MoEModel
from engine.store import manifest as mf
from engine.models.common import layer_ahead_predictor
from engine.tiers.tiered import TieredExperts
ck, store, tokens, gpu, ram = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)
with torch.inference_mode():
    prov = TieredExperts(mf.load(store), store, device="cpu", gpu_slots=gpu, ram_slots=ram, readers=2)
    prov.preload()
    model = load_model(ck, provider=prov, device="cpu", max_context=tokens + 64)
    prov.use_predictor(layer_ahead_predictor(model))
    prompt = [(31 * i + 7) % 2000 for i in range(32)]
    tok = int(model.prefill(torch.tensor(prompt), 0).argmax())
    for i in range(8):                                   # warm: first tables, first misses
        tok = int(model.decode_step([tok], [0], [len(prompt) + i]).argmax())
    h0, c0, t0 = prov.host_seconds, prov.counters(), time.perf_counter()
    for i in range(tokens):
        tok = int(model.decode_step([tok], [0], [len(prompt) + 8 + i]).argmax())
    wall, h1, c1 = time.perf_counter() - t0, prov.host_seconds, prov.counters()
    layers = len(mf.load(store).moe_layers)
    print(json.dumps({"host_us_per_layer": (h1 - h0) / (tokens * layers) * 1e6,
                      "step_ms": wall / tokens * 1e3,
                      "slot_misses_per_token": (c1["tiers"]["gpu"]["misses"] - c0["tiers"]["gpu"]["misses"]) / tokens,
                      "store_reads": c1["store_reads"] - c0["store_reads"]}))
    prov.close()
"""


ROUND_ZERO_COPY = r"""
import json, os, sys, time, torch
os.environ["TRITON_INTERPRET"] = "1"                 # the slot kernels' availability on a CPU device; none runs here
from engine.store import manifest as mf
from engine.tiers.tiered import TieredExperts
store, trace, gpu, ram = sys.argv[2], sys.argv[6], int(sys.argv[4]), int(sys.argv[5])
m = mf.load(store)
rows = {l: i for i, l in enumerate(m.moe_layers)}
steps, cur = [], {}
for line in open(trace):
    r = json.loads(line)
    if r["layer"] in cur:
        steps.append(cur)
        cur = {}
    cur[r["layer"]] = r["experts"]
steps.append(cur)
steps = [s for s in steps if len(s) == len(rows) and all(len(v) == 8 for v in s.values())]   # decode steps, top-8
prov = TieredExperts(m, store, device="cpu", gpu_slots=gpu, ram_slots=ram, readers=2)
prov.preload()
assert prov.use_zero_copy("on")
zc = prov.zero_copy
# The promotion budget follows the step time and copy rate, which a CPU without kernels does not have: the H200's
# (0.5 x its ~2.5 ms step x 54 GB/s over 9.44 MB records), in every tree alike.
zc.budget = lambda: 7
t0 = h0 = None
for n, step in enumerate(steps):
    if n == 8:                                         # warm: the first logs, the first write-backs
        h0, t0 = zc.host_seconds, time.perf_counter()
    for layer, experts in step.items():
        zc.log[rows[layer], :8] = torch.tensor(experts, dtype=torch.int32)
    prov.before_decode()
    prov.after_decode_launch(8)
k = len(steps) - 8
c = prov.counters()
print(json.dumps({"host_us_per_step": (zc.host_seconds - h0) / k * 1e6,
                  "host_us_per_layer": (zc.host_seconds - h0) / (k * len(rows)) * 1e6,
                  "steps": k, "ram_picks_per_step": c["zero_copy"]["picks"]["ram"] / len(steps),
                  "promotions": c["zero_copy"]["promotions"], "demotions": c["zero_copy"]["demotions"]}))
prov.close()
"""

RECORD = r"""
import sys, torch
from engine.loader import load_model
from engine.store import manifest as mf
from engine.tiers.tiered import TieredExperts
ck, store, tokens, trace = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with torch.inference_mode():
    prov = TieredExperts(mf.load(store), store, device="cpu", ram_slots=len(mf.load(store).records), readers=2,
                         trace=trace)
    model = load_model(ck, provider=prov, device="cpu", max_context=tokens + 64)
    prompt = [(31 * i + 7) % 2000 for i in range(32)]
    tok = int(model.prefill(torch.tensor(prompt), 0).argmax())
    for i in range(tokens + 8):
        tok = int(model.decode_step([tok], [0], [len(prompt) + i]).argmax())
    prov.close()
"""


def record_routing(ck: Path, store: Path, tokens: int, work: Path) -> Path:
    """The model's own routing over `tokens` + 8 greedy decode steps (TieredExperts' trace, JSON lines)."""
    trace = work / f"routing-{tokens}.jsonl"
    if not trace.exists():
        subprocess.run([sys.executable, "-c", RECORD, str(ck), str(store), str(tokens), str(trace)], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), check=True)
    return trace


def synth(work: Path) -> tuple[Path, Path]:
    ck, store = work / "model", work / "store"
    if not (store / "manifest.json").exists():
        s = SHAPE
        subprocess.run([sys.executable, "-m", "engine", "synth", "--out", str(ck), "--store", str(store),
                        "--layers", str(s["layers"]), "--hidden", str(s["hidden"]), "--experts", str(s["experts"]),
                        "--top-k", str(s["top_k"]), "--moe-intermediate", str(s["moe_intermediate"]),
                        "--vocab", str(s["vocab"]), "--device", "cpu"], cwd=REPO, check=True)
    return ck, store


def one_round(tree: Path, ck: Path, store: Path, tokens: int, trace: Path | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    script, extra = (ROUND_ZERO_COPY, [str(trace)]) if trace else (ROUND, [])
    out = subprocess.run([sys.executable, "-c", script, str(ck), str(store), str(tokens), str(SLOTS["gpu"]),
                          str(SLOTS["ram"]), *extra], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"round in {tree} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=None, help="another checkout to compare against (bench/trees.py)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", default=None)
    ap.add_argument("--zero-copy", action="store_true", help="zero-copy decode's host work per step (see above)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out_path = args.out or str(REPO / "bench" / "results" / ("host_step_zero_copy.json" if args.zero_copy
                                                             else "host_step.json"))
    work = Path(args.work or tempfile.mkdtemp(prefix="host-step-"))
    ck, store = synth(work)
    trace = record_routing(ck, store, args.tokens, work) if args.zero_copy else None
    trees = {f"this tree ({tree_commit(REPO)})": REPO}
    if args.tree:
        tree = Path(args.tree).resolve()
        trees[f"{tree} ({tree_commit(tree)})"] = tree
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):                         # interleaved: the box is shared and noisy
        for name, tree in trees.items():
            rounds[name].append(one_round(Path(tree), ck, store, args.tokens, trace))
    load = os.getloadavg()
    res = {name: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} | {"rounds": rs}
           for name, rs in rounds.items()}
    doc = {"command": "python3 bench/probes/host_step.py" + (" --zero-copy" if args.zero_copy else "")
           + (f" --tree {args.tree}" if args.tree else ""),
           "what": "zero-copy decode's host work per step (no kernels; the model's recorded routing)" if args.zero_copy
           else "the piecewise tiered decode's host step per MoE layer",
           "shape": SHAPE, "slots": SLOTS, "tokens": args.tokens, "loadavg": load, "results": res}
    Path(out_path).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.rounds} rounds of {args.tokens} tokens, medians")
    if args.zero_copy:
        print("| tree | host µs / step | host µs / MoE layer | RAM-tier picks / step | promotions | write-backs |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in res.items():
            print(f"| {name} | {r['host_us_per_step']:.1f} | {r['host_us_per_layer']:.2f} | "
                  f"{r['ram_picks_per_step']:.2f} | {r['promotions']:.0f} | {r['demotions']:.0f} |")
        print("wrote", out_path)
        return
    print("| tree | host step µs / layer | step ms | slot misses / token | store reads |")
    print("|---|---:|---:|---:|---:|")
    for name, r in res.items():
        print(f"| {name} | {r['host_us_per_layer']:.1f} | {r['step_ms']:.2f} | {r['slot_misses_per_token']:.2f} | "
              f"{r['store_reads']:.0f} |")
    print("wrote", out_path)


if __name__ == "__main__":
    main()

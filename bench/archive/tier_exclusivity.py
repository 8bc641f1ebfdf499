"""Store reads of the tiered provider when its slot and RAM tiers together could hold every record, on any CPU.

  python3 bench/tier_exclusivity.py --out bench/results/tier_exclusivity.json
  python3 bench/tier_exclusivity.py --tree /tmp/old-checkout --out /tmp/before.json   # another tree's engine

The H200's 24 GB-budget run read 3,544 of its 3,671 GPU-slot misses from the store although its 2,149 GPU +
1,820 RAM slots exceed the 3,072 records: the RAM tier cached what it last fetched, i.e. the GPU slots' own recent records.
This bench drives the real TieredExperts (a CPU "device" with a slot tier in host memory, the same code as
on CUDA but memcpy for copies; real O_DIRECT store reads) through a greedy decode of a random qwen3_moe
checkpoint (tests/fixtures/tiny_models: 4 layers x 64 experts, top-8, so routing spreads), with the tiers
sized so that slot + RAM slots >= records, and prints store reads and bytes per decoded token beside the
bound (every record read once: records / tokens) and the decode rate. Rounds alternate the sizes; medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
from bench.harness import parse_with_tree


def run(ck: Path, store: Path, gpu_slots: int, ram_slots: int, prompt: list[int], tokens: int) -> dict:
    import torch
    from engine.loader import load_model
    from engine.store import manifest as mf
    from engine.tiers.tiered import TieredExperts
    m = mf.load(store)
    with torch.inference_mode():
        prov = TieredExperts(m, store, device="cpu", gpu_slots=gpu_slots, ram_slots=ram_slots, readers=2)
        try:
            model = load_model(ck, provider=prov, device="cpu", max_context=len(prompt) + tokens + 8)
            out = [int(model.prefill(torch.tensor(prompt), 0).argmax())]
            before = prov.counters()
            t0 = time.perf_counter()
            for i in range(tokens - 1):
                out.append(int(model.decode_step([out[-1]], [0], [len(prompt) + i]).argmax()))
            seconds = time.perf_counter() - t0
            c = prov.counters()
        finally:
            prov.close()
    reads = c["store_reads"] - before["store_reads"]
    return {"gpu_slots": gpu_slots, "ram_slots": ram_slots, "records": len(m.records),
            "decode_tokens": tokens - 1, "store_reads_decode": reads, "store_reads_total": c["store_reads"],
            "store_bytes_per_token": round(reads * m.record_bytes / (tokens - 1)),
            "writebacks": c.get("writebacks"), "served": c["served"], "decode_tps": round((tokens - 1) / seconds, 1),
            "tokens": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    args, tree, commit = parse_with_tree(ap)
    import torch
    from engine.store.pack import pack_store                 # the tree's engine
    from tests.fixtures.tiny_models import make_tiny_checkpoint
    torch.set_num_threads(1)
    # (gpu, ram) slots over 256 records: slot + RAM = records + 8, split three ways; and a RAM tier that alone
    # holds everything (the store is read once whatever the policy: the bound's own check)
    sizes = [(64, 200), (128, 136), (192, 72), (64, 256)]
    out = {"what": __doc__.splitlines()[0], "command": "python3 bench/tier_exclusivity.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "tree": str(tree), "commit": commit, "cpus": os.cpu_count(),
           "runs": {}}
    with tempfile.TemporaryDirectory(dir=os.environ.get("KILN_BENCH_TMP", "/var/tmp")) as d:
        ck = make_tiny_checkpoint("qwen3_moe", Path(d) / "model", layers=4, experts=64, top_k=8)
        store = Path(d) / "store"
        pack_store(ck, store, dtype=torch.float32)
        prompt = [(37 * i + 11) % 300 for i in range(32)]
        rounds: dict[str, list[dict]] = {f"{g}+{r}": [] for g, r in sizes}
        for k in range(args.rounds):
            load = round(os.getloadavg()[0], 2)
            for g, r in sizes:
                res = run(ck, store, g, r, prompt, args.tokens)
                res["loadavg_1m"] = load
                rounds[f"{g}+{r}"].append(res)
                print(f"round {k}: gpu {g} + ram {r}: {res['store_reads_decode']} store reads in "
                      f"{res['decode_tokens']} tokens, {res['decode_tps']} tok/s, load {load}", flush=True)
        for name, rs in rounds.items():
            first = rs[0]
            assert all(r["tokens"] == first["tokens"] for r in rs)
            out["runs"][name] = {**{k: v for k, v in first.items() if k not in ("tokens", "decode_tps", "served")},
                                 "store_reads_decode_median": statistics.median(r["store_reads_decode"] for r in rs),
                                 "decode_tps_median": statistics.median(r["decode_tps"] for r in rs),
                                 "bound_store_reads": first["records"], "rounds": len(rs)}
        same = len({json.dumps(rs[0]["tokens"]) for rs in rounds.values()}) == 1
        out["same_tokens_at_every_size"] = same
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\ntree {tree} ({commit}); same tokens at every size: {same}")
    print("| gpu + ram slots (256 records) | store reads, whole run (bound 256) | store reads in decode | "
          "store MB/token | writebacks | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in out["runs"].items():
        print(f"| {name} | {r['store_reads_total']} | {r['store_reads_decode_median']} | "
              f"{r['store_bytes_per_token'] / 1e6:.3f} | {r['writebacks']} | {r['decode_tps_median']} |")


if __name__ == "__main__":
    main()

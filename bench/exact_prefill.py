"""Exact prefill on the CPU demo's model (issue 32): prefill speed of the decode kernels row by row (the engine's
prefill now, MoEModel.exact_prefill) against the torch forms' prefill it replaced, and the bits it buys.

  python -m bench.exact_prefill --workdir /tmp/kiln-quant-demo --out bench/results/DATE-exact-prefill.json

The demo recipe's model and q4_1 store (bench.quant_demo_speed.prepare: converted and packed as the recipe does),
loaded once in this process with the recipe's expert store. Each round prefills one --tokens prompt per side, the
sides alternating within a round (bench.harness.interleaved), the host load beside every round. Exactness: the
keys, values and logits of a whole prefill against a prefill of 7 then decode steps, and against chunks of other
lengths (bit for bit, or not).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.harness import interleaved, log, median_spread, prompt_ids, table, write_result
from bench.quant_demo_speed import GGUF_NAME, prepare


def exactness(model, n: int) -> dict:
    toks = prompt_ids(n, 49000, seed=11)
    with torch.inference_mode():
        whole = model.prefill(toks, 0, all_logits=True)
        kw = model.kv.k[:, 0, :n].clone(), model.kv.v[:, 0, :n].clone()
        stepped = [model.prefill(toks[:7], 1)]
        for p in range(7, n):
            stepped.append(model.decode_step([toks[p]], [1], [p])[0])
        kd = model.kv.k[:, 1, :n].clone(), model.kv.v[:, 1, :n].clone()
        chunks, done = [], 0
        while done < n:
            size = min(n - done, (13, 40, 5)[len(chunks) % 3])
            chunks.append(model.prefill(toks[done:done + size], 2, start=done, all_logits=True))
            done += size
        kc = model.kv.k[:, 2, :n].clone(), model.kv.v[:, 2, :n].clone()
    return {"tokens": n,
            "kv_prefill_vs_decode_equal": all(torch.equal(a, b) for a, b in zip(kw, kd)),
            "kv_prefill_vs_chunked_equal": all(torch.equal(a, b) for a, b in zip(kw, kc)),
            "logits_prefill_vs_decode_equal": torch.equal(torch.stack(stepped), whole[6:]),
            "logits_prefill_vs_chunked_equal": torch.equal(torch.cat(chunks), whole),
            "logits_prefill_vs_decode_max_abs_diff": float((torch.stack(stepped) - whole[6:]).abs().max())}


def main():
    from engine.loader import load_model
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kiln-quant-demo"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    gguf = args.workdir / GGUF_NAME
    if not gguf.exists():
        raise SystemExit(f"{gguf}: not there (python -m bench.chat_turns --workdir {args.workdir} extracts it)")
    paths = prepare(gguf, args.workdir, ["q4_1"])
    model = load_model(paths["model"], store_dir=paths["q4_1"], device="cpu", max_context=2048, max_batch=3)
    assert model.exact_prefill, "the demo model does not take the exact prefill path"
    toks = prompt_ids(args.tokens, 49000, seed=3)

    def side(exact: bool):
        def run() -> dict:
            model._exact_prefill = exact
            with torch.inference_mode():
                t0 = time.perf_counter()
                model.prefill(toks, 0)
                dt = time.perf_counter() - t0
            return {"seconds": round(dt, 4), "tok_s": round(len(toks) / dt, 1)}
        return run
    rounds = interleaved({"exact_rows": side(True), "torch_forms": side(False)}, args.rounds)
    model._exact_prefill = True
    stats = {n: median_spread([r[n]["tok_s"] for r in rounds]) for n in ("exact_rows", "torch_forms")}
    exact = exactness(model, 64)
    model._exact_prefill = False
    before = exactness(model, 64)
    model._exact_prefill = True
    doc = {"what": f"prefill of {args.tokens} tokens on the CPU demo's model (SmolLM2 Q4_1, 8 experts top-1, the "
                   "recipe's store): the decode kernels row by row (exact prefill) vs the torch forms, interleaved; "
                   "bitwise agreement of prefill, decode and chunked prefill",
           "threads": torch.get_num_threads(), "prefill_tok_s": stats,
           "exact_over_torch_forms": round(stats["exact_rows"]["median"] / stats["torch_forms"]["median"], 3),
           "exactness_exact_rows": exact, "exactness_torch_forms": before, "rounds": rounds}
    write_result(args.out, doc)
    table([{"prefill": n, "tok/s (median)": stats[n]["median"], "min": stats[n]["min"], "max": stats[n]["max"],
            "bit-exact vs decode": (exact if n == "exact_rows" else before)["logits_prefill_vs_decode_equal"]}
           for n in stats], ["prefill", "tok/s (median)", "min", "max", "bit-exact vs decode"])
    log(f"exact / torch forms: {doc['exact_over_torch_forms']}x")


if __name__ == "__main__":
    main()

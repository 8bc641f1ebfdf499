"""Why Kiln and llama.cpp differ on the same SmolLM2 GGUF (issue 29): llama.cpp's rounding, emulated on the fp32 model.

  python -m bench.gguf_rounding --work /tmp/gguf-agree --out bench/results/2026-12-05-gguf-rounding-smollm2.json

After bench/gguf_agreement.py on the same WORK and --positions (it leaves llama-server's distributions beside each
file: FILE.llama-full-N.pt, whole, or FILE.llama-top20-N.pt). Per file, on the same teacher-forced token ids, four
distributions against llama-server's (top-1 agreement; KL(llama ‖ x), exact where llama's is whole, else a lower
bound over its top-20) and against the fp32 reference:
  kiln          Kiln in-process on the GGUF alone (what `engine serve` serves: bench/gguf_agreement.py holds the two
                equal)
  plain         the fp32 transformers model with the file's own weights (dequantized), float arithmetic
  act           the same, each matmul input rounded to q8_0 / q8_K as ggml's CPU does for that weight's type
  act+f16attn   and attention's Q, K, V rounded to F16 (llama.cpp's F16 KV cache and flash attention's F16 Q)
(engine.measure.ggml_rounding). If the gap is llama.cpp's activation rounding, `act` moves from Kiln to llama.cpp.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from bench.gguf_agreement import POSITIONS, doc_ids, llama_cache
from bench.harness import add_to_index, host_load, index_row, log, table, write_result
from engine.measure import gguf_agreement as ga
from engine.measure import ggml_rounding as gr

VARIANTS = {"plain": dict(activations=False), "act": dict(activations=True),
            "act+f16attn": dict(activations=True, attention_f16=True)}


def kl(r: dict) -> str:
    """The KL figure of a comparison: exact, or '≥ bound' where llama's side was a top-N."""
    return f"{r['kl_mean_nats']:.6f}" if "kl_mean_nats" in r else f"≥ {r['kl_mean_nats_lower_bound']:.6f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="bench/gguf_files.py's --work (its files.json)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2", help="a llama-architecture model of files.json")
    ap.add_argument("--types", default=None, help="comma list of types (default: every one with llama's distribution)")
    ap.add_argument("--positions", type=int, default=POSITIONS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--index", action="store_true", help="add the result's row to bench/results/index.jsonl")
    a = ap.parse_args(argv)
    from engine.kernels.cpu import set_compute_threads
    from engine.llm import LLM
    from transformers import AutoTokenizer
    set_compute_threads(a.threads)
    torch.set_num_threads(a.threads)
    m = json.loads((a.work / "files.json").read_text())["models"].get(a.model)
    if m is None:
        raise SystemExit(f"--model: {a.model} is not in {a.work / 'files.json'}")
    ck = m["checkpoint"]
    ids = doc_ids(AutoTokenizer.from_pretrained(ck), a.positions)
    n = len(ids) - 1
    ref = ga.reference_logprobs(ck, ids)[:n]
    doc = json.loads(a.out.read_text()) if a.out.is_file() else {}
    doc.update({"what": __doc__.splitlines()[0], "model": a.model, "positions": n, "variants": VARIANTS,
                "kl_note": "kl_mean_nats: exact (llama-server's whole distribution, n_probs = the vocabulary); "
                           "kl_mean_nats_lower_bound: over llama's top-20 and one rest bin",
                "host_load_start": host_load()})
    doc.setdefault("types", {})
    for q in (a.types.split(",") if a.types else list(m["files"])):
        path = Path(m["files"][q]["path"])
        cache = next((c for c in (llama_cache(path, len(ids), True), llama_cache(path, len(ids), False))
                      if c.is_file()), None)
        if cache is None:
            log(f"{q}: llama-server's distributions are not there (run bench/gguf_agreement.py with --positions "
                f"{a.positions} first): skipped")
            continue
        t0 = time.perf_counter()
        llama = torch.load(cache)
        full = isinstance(llama, torch.Tensor)

        def vs_llama(lp):       # exact where llama's distribution is whole, else over its top-N (KL a lower bound)
            return ga.compare_full(llama, lp) if full else ga.compare_topn(llama, lp, topn_is_reference=True)
        llm = LLM.load(path, max_context=2048, max_batch=1, threads=a.threads)
        try:
            sides = {"kiln": ga.kiln_logprobs(llm, ids)[:n]}
        finally:
            llm.close()
            del llm
            gc.collect()
        for v, kw in VARIANTS.items():
            sides[v] = gr.emulated_logprobs(ck, path, ids, **kw)[:n]
        r = {"file": path.name, "tensor_types": ga.tensor_types(path), "llama_distribution": cache.name,
             "llama_vs_reference": ga.compare_full(ref, llama) if full else
             ga.compare_topn(llama, ref, topn_is_reference=False)}
        for s, lp in sides.items():
            r[s] = {"vs_llama": vs_llama(lp), "vs_kiln": ga.compare_full(sides["kiln"], lp),
                    "vs_reference": ga.compare_full(ref, lp)}
        r["seconds"] = round(time.perf_counter() - t0, 1)
        doc["types"][q] = r
        doc["host_load_end"] = host_load()
        write_result(a.out, doc)
        log(f"{q}: top-1 vs llama " + ", ".join(f"{s} {r[s]['vs_llama']['top1_agreement']:.4f} "
                                                 f"(KL {kl(r[s]['vs_llama'])})" for s in sides))
        del llama, sides
        gc.collect()
    rows = [{"type": q, **{f"top1 {s}/llama": r[s]["vs_llama"]["top1_agreement"] for s in ("kiln", *VARIANTS)},
             **{f"KL llama‖{s}": kl(r[s]["vs_llama"]) for s in ("kiln", *VARIANTS)},
             **{f"top1 {s}/kiln": r[s]["vs_kiln"]["top1_agreement"] for s in VARIANTS},
             "top1 act/ref": r["act"]["vs_reference"]["top1_agreement"],
             "top1 llama/ref": r["llama_vs_reference"]["top1_agreement"]} for q, r in doc["types"].items()]
    doc["table"] = table(rows, list(rows[0]) if rows else [])
    write_result(a.out, doc)
    if a.index and doc["types"]:
        add_to_index(index_row(a.out, {f"{a.model}_{q}_top1_vs_llama_{s}": r[s]["vs_llama"]["top1_agreement"]
                                       for q, r in doc["types"].items() for s in ("kiln", "act", "act+f16attn")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

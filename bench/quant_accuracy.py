"""Quantized experts against the float model: top-1 agreement and KL over teacher-forced positions, and
greedy tokens on the demo prompts.

  python3 bench/quant_accuracy.py --smollm2 MODEL_DIR --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
      --out bench/results/quant_accuracy.json

MODEL_DIR is `engine convert`'s checkpoint of the GGUF (fp32: the GGUF's weights dequantized exactly), so the
fp32 model is the reference; against it: bf16 records, int8 and int4 quantized at pack time from those fp32
weights, and q4_1 (the GGUF's own blocks in the CPU's int4 layout: what the demo serves). The synthetic
checkpoint (tests/fixtures/tiny_models: a random bf16 Qwen3-MoE, 16 experts of 256 x 128) is measured the same
way on random tokens. Positions: --chunks sequences of --chunk tokens from this repository's docs,
each prefilled whole (every position's logits, teacher-forced). KL is KL(reference ‖ quantized) in nats,
mean over positions. 4-bit records compute with the CPU's int4 kernel, as the engine serves them; 8-bit ones
with their dequantized values (what their dequantize-per-call CPU path computes).

--attention-blocks DIR adds "q4_1 + attention blocks": the q4_1 records on `engine convert --attention-blocks`'s
checkpoint of the same GGUF (its attention kept as the file's Q4_1 blocks, computed by the CPU's int4 kernel:
what the demo serves), against the same fp32 reference. --only picks variants; --no-synthetic skips the
synthetic checkpoint.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GREEDY = 20
PROMPTS = ["Name three primary colors, comma separated.", "What is 17 * 23? Reply with only the number.",
           "What's the weather in Paris right now?"]


# Records measured. Served: the records as pack-store makes them and the CPU computes them (int8 dequantized
# per call, 4-bit through torch's int4 kernel with bf16 activations). Sweep ("scheme gN ..."): a group size
# or scale rule, its weights dequantized into fp32 records, so the grid alone is measured; "former" is the
# default before this measurement: 128 where it divides the input dimension, else 64, int8 scaled absmax/127.
SERVED = ("bf16", "int8", "int4", "q4_1")
WITH_ATTENTION_BLOCKS = "q4_1 + attention blocks"     # --attention-blocks: q4_1 records on that checkpoint
SWEEP = {"int8 former": ("int8", "former", (127,)), "int4 former": ("int4", "former", None),
         "int4 g64": ("int4", 64, None), "int8 g32 absmax": ("int8", 32, (127,)),
         "int4 g128": ("int4", 128, None), "int4 g32 fp32": ("int4", 32, None)}


def _former_group(inp: int) -> int:
    return next(g for g in (128, 64, 32) if inp % g == 0)


def sweep_matrix(spec, w: torch.Tensor) -> torch.Tensor:
    """One matrix quantized by a SWEEP spec and dequantized (float32)."""
    from engine.quant.records import dequantize_matrix, quantize_int4, quantize_int8
    scheme, group, divisors = spec
    g = _former_group(w.shape[1]) if group == "former" else group
    buf = quantize_int8(w, g, divisors) if scheme == "int8" else quantize_int4(w, g)
    return dequantize_matrix(scheme, buf, *w.shape, group=g)


def applies(ck, variant: str) -> bool:
    """A sweep group that does not divide both input dimensions (SmolLM2's 576 and 128) is left out."""
    if variant not in SWEEP or SWEEP[variant][1] == "former":
        return True
    return all(n % SWEEP[variant][1] == 0 for n in (ck.hidden, ck.moe_intermediate))


def provider(ck, variant: str, gguf: str | None):
    """An all-in-memory provider of `variant` records. An upcycled checkpoint's identical experts share one
    record (made once per layer). 8-bit records, which the CPU serves by dequantizing per call, are held here
    as their dequantized fp32 values: the same numbers, without re-dequantizing them on every call."""
    from engine.experts import ExpertLayout
    from engine.tiers.memory import InMemoryExperts
    from engine.quant.source import record_source
    if variant in ("fp32", "bf16"):
        layout, make = record_source(ck, dtype=torch.float32 if variant == "fp32" else torch.bfloat16, order="cols")
    elif variant == "q4_1":
        layout, make = record_source(ck, order="cols", quant="gguf", gguf=gguf)
    elif variant in SWEEP:
        layout = ExpertLayout(ck.hidden, ck.moe_intermediate, torch.float32, "cols")
        make = lambda l, e: layout.pack(*(sweep_matrix(SWEEP[variant], m.float()) for m in ck.expert(l, e)))  # noqa: E731
    else:
        layout, make = record_source(ck, order="cols", quant=variant)
    if layout.quantized and not layout.quantized.cpu_int4:
        qlay, qmake = layout.quantized, make
        layout = ExpertLayout(ck.hidden, ck.moe_intermediate, torch.float32, "cols")
        make = lambda l, e: layout.pack(*qlay.dequantize(qmake(l, e)))       # noqa: E731
    records = {}
    for l in ck.moe_layers:
        first = ck.expert(l, 0)
        rec0 = make(l, 0)
        recs = [rec0 if e == 0 or all(torch.equal(a, b) for a, b in zip(first, ck.expert(l, e))) else make(l, e)
                for e in range(ck.n_experts)]
        records[l] = torch.stack(recs)
    return InMemoryExperts(layout, records)


def compare(ref_logits: list[torch.Tensor], logits: list[torch.Tensor]) -> dict:
    agree, kl, n = 0, 0.0, 0
    for a, b in zip(ref_logits, logits):
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        kl += float(F.kl_div(F.log_softmax(b.double(), -1), F.log_softmax(a.double(), -1), log_target=True,
                             reduction="sum"))
        n += a.shape[0]
    return {"positions": n, "top1_agreement": round(agree / n, 4), "kl_mean_nats": round(kl / n, 5)}


def run_model(model_dir, ck, variant, gguf, chunks, prompts, dtype="float32") -> tuple[list, list]:
    from engine.loader import load_model
    m = load_model(model_dir, provider=provider(ck, variant, gguf), device="cpu", dtype=dtype,
                   max_context=max(len(c) for c in chunks) + 64, max_batch=1)
    out, greedy = [], []
    with torch.inference_mode():
        for c in chunks:
            out.append(m.prefill(c, 0, all_logits=True).float())
        for p in prompts:
            lg = m.prefill(p, 0)
            toks = [int(lg.argmax())]
            for i in range(GREEDY - 1):
                toks.append(int(m.decode_step([toks[-1]], [0], [len(p) + i]).argmax()))
            greedy.append(toks)
    return out, greedy


def measure(name, model_dir, variants, chunks, prompts, gguf=None, tokenizer=None, res=None, saved=lambda: None,
            other_dirs: dict | None = None) -> dict:
    """Every variant against the fp32 reference, into `res` (a dict), calling saved() after each one so a
    long run that is stopped keeps what it measured. other_dirs: variant -> (model dir, the records it uses),
    a variant whose non-expert weights come from another checkpoint of the same model."""
    other_dirs = other_dirs or {}
    from engine.checkpoint import Checkpoint
    ck = Checkpoint(model_dir)
    t0 = time.time()
    ref, ref_greedy = run_model(model_dir, ck, "fp32", gguf, chunks, prompts)
    res = {} if res is None else res
    res.update({"reference": "fp32", "load_avg": [round(os.getloadavg()[0], 2)], "variants": {}})
    if tokenizer:
        res["reference_greedy"] = [tokenizer.decode(t) for t in ref_greedy]
    for v in (v for v in variants if applies(ck, v)):
        vdir, records = other_dirs.get(v, (model_dir, v))
        logits, greedy = run_model(vdir, ck, records, gguf, chunks, prompts)
        r = compare(ref, logits)
        same = [next((i for i, (a, b) in enumerate(zip(g, rg)) if a != b), None) for g, rg in zip(greedy, ref_greedy)]
        r["greedy_prompts_identical"] = sum(s is None for s in same)
        r["greedy_first_divergence"] = same
        if tokenizer:
            r["greedy"] = [tokenizer.decode(t) for t in greedy]
        res["variants"][v] = r
        res["load_avg"].append(round(os.getloadavg()[0], 2))
        res["seconds"] = round(time.time() - t0, 1)
        saved()
        print(f"{name:8} {v:16} top-1 {r['top1_agreement']:.4f}  KL {r['kl_mean_nats']:.5f}  "
              f"greedy identical {r['greedy_prompts_identical']}/{len(prompts)} {same}", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", required=True, help="engine convert's checkpoint of the SmolLM2 GGUF")
    ap.add_argument("--gguf", required=True, help="the SmolLM2 Q4_1 GGUF it was converted from")
    ap.add_argument("--out", required=True)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--attention-blocks", default=None,
                    help="engine convert --attention-blocks's checkpoint of the same GGUF (with expert weights)")
    ap.add_argument("--only", default=None, help="comma list of the variants to measure (default: all)")
    ap.add_argument("--no-synthetic", action="store_true", help="skip the synthetic checkpoint")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    keep = lambda vs: [v for v in vs if only is None or v in only]      # noqa: E731
    from engine.kernels.cpu import set_compute_threads
    from transformers import AutoTokenizer
    set_compute_threads(2)
    tok = AutoTokenizer.from_pretrained(args.smollm2)
    text = "\n\n".join((REPO / p).read_text() for p in ("README.md", "bench/README.md", "engine/experts.py",
                                                         "engine/quant/records.py"))
    ids = tok(text)["input_ids"]
    need = args.chunk * args.chunks
    if len(ids) < need:
        raise SystemExit(f"the docs give {len(ids)} tokens, {need} are needed")
    chunks = [ids[i * args.chunk:(i + 1) * args.chunk] for i in range(args.chunks)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    out = {"what": __doc__.strip().splitlines()[0], "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": "python3 bench/quant_accuracy.py " + " ".join(sys.argv[1:]),
           "text_tokens_sha256": hashlib.sha256(json.dumps(ids[:need]).encode()).hexdigest()[:16],
           "positions_per_model": need, "served": list(SERVED), "sweep": {k: list(map(str, v[:2])) for k, v in SWEEP.items()}, "prompts": PROMPTS, "greedy_tokens": GREEDY, "models": {}}
    out["complete"] = False

    def saved():
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(out, indent=2) + "\n")
        tmp.replace(args.out)
    # The synthetic checkpoint first (seconds), then SmolLM2's served records, then its sweep (an hour on a
    # busy 2-core host): the JSON is rewritten after every variant.
    if not args.no_synthetic:
        from tests.fixtures.tiny_models import make_tiny_checkpoint
        with tempfile.TemporaryDirectory() as d:
            synth = make_tiny_checkpoint("qwen3_moe", d, hidden=256, experts=16, layers=4, top_k=4, dtype="bfloat16")
            g = torch.Generator().manual_seed(0)
            rchunks = [torch.randint(0, 384, (args.chunk,), generator=g).tolist() for _ in range(args.chunks)]
            rprompts = [torch.randint(0, 384, (12,), generator=g).tolist() for _ in range(len(PROMPTS))]
            out["models"]["synthetic-qwen3-moe-bf16"] = {}
            measure("synth", synth, keep(["int8", "int4", *SWEEP]), rchunks, rprompts,
                    res=out["models"]["synthetic-qwen3-moe-bf16"], saved=saved)
    out["models"]["smollm2-135m"] = {}
    variants, other = [*SERVED, *SWEEP], {}
    if args.attention_blocks:
        variants.insert(len(SERVED), WITH_ATTENTION_BLOCKS)
        other[WITH_ATTENTION_BLOCKS] = (args.attention_blocks, "q4_1")
    measure("smollm2", args.smollm2, keep(variants), chunks, prompts, gguf=args.gguf, tokenizer=tok,
            res=out["models"]["smollm2-135m"], saved=saved, other_dirs=other)
    out["complete"] = True
    saved()
    print(f"\n{'model':20} {'records':16} {'top-1':>7} {'KL nats':>9} {'greedy =':>8}")
    for mname, m in out["models"].items():
        for v, r in m["variants"].items():
            print(f"{mname:20} {v:16} {r['top1_agreement']:7.4f} {r['kl_mean_nats']:9.5f} "
                  f"{r['greedy_prompts_identical']:>4}/{len(PROMPTS)}")


if __name__ == "__main__":
    main()

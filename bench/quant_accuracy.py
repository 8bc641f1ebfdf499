"""Quantized experts against the float model: top-1 agreement and KL over teacher-forced positions, and
greedy tokens on the demo prompts.

  python -m bench.quant_accuracy --smollm2 MODEL_DIR --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
      --out bench/results/quant_accuracy.json

MODEL_DIR is `engine convert`'s checkpoint of the GGUF (fp32: the GGUF's weights dequantized exactly), so the
fp32 model is the reference; against it: bf16 records, int8 and int4 quantized at pack time from those fp32
weights, and q4_1 (the GGUF's own blocks in the CPU's int4 layout: what the demo serves). The synthetic
checkpoint (tests/fixtures/tiny_models: a random bf16 Qwen3-MoE, 16 experts of 256 x 128) is measured the same
way on random tokens (the measure is engine/measure/quant_accuracy.py's). Positions: --chunks sequences of --chunk tokens from this repository's docs,
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
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import write_result
from engine.measure.quant_accuracy import GREEDY, SERVED, SWEEP, WITH_ATTENTION_BLOCKS, measure

REPO = Path(__file__).resolve().parent.parent

PROMPTS = ["Name three primary colors, comma separated.", "What is 17 * 23? Reply with only the number.",
           "What's the weather in Paris right now?"]


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
           "command": "python -m bench.quant_accuracy " + " ".join(sys.argv[1:]),
           "text_tokens_sha256": hashlib.sha256(json.dumps(ids[:need]).encode()).hexdigest()[:16],
           "positions_per_model": need, "served": list(SERVED), "sweep": {k: list(map(str, v[:2])) for k, v in SWEEP.items()}, "prompts": PROMPTS, "greedy_tokens": GREEDY, "models": {}}
    out["complete"] = False

    def saved():
        write_result(Path(args.out), out)
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

"""Do the demo's greedy tokens change with the native decode? The recipe's model and q4_1 store (as
bench/quant_demo_speed.py prepares them), its RAM tier, decoded through LLM greedily on quant_accuracy's three demo
prompts and the speed gate's chat prompt, with EngineConfig.native_kernels on and off; the first differing position
per prompt (None: identical).

  PYTHONPATH=$PWD python3 bench/probes/native_greedy.py MODEL_DIR STORE_DIR [--tokens 64] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("store", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from bench.quant_accuracy import PROMPTS
    from transformers import AutoTokenizer
    from engine.llm import LLM, SamplingParams
    from tool.checks.speed import MESSAGES
    tok = AutoTokenizer.from_pretrained(args.model)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS] + [MESSAGES]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    prompts = [list(p if isinstance(p, list) else p["input_ids"]) for p in prompts]
    runs = {}
    for native in (True, False):
        with LLM.load(args.model, args.store, max_context=8192, max_batch=4, ram_slots=232, native_kernels=native) as llm:
            runs[native] = [[t.id for t in llm.generate(p, SamplingParams(max_tokens=args.tokens, ignore_eos=True))]
                            for p in prompts]
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(runs[True], runs[False])]
    out = {"what": __doc__.strip().splitlines()[0], "tokens": args.tokens, "first_difference": first,
           "identical": sum(f is None for f in first), "prompts": len(prompts),
           "text_native": [tok.decode(t) for t in runs[True]]}
    print(json.dumps(out, indent=2))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

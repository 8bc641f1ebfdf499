"""What the native MoE half (MixtralBlock.native_step → engine.kernels.native.MoETail) saves a demo decode step:
one process, the recipe's model, q4_1 store, RAM tier and KV cache (as bench/quant_demo_speed.py prepares them),
rounds of decode steps alternating between the MoE half in one native call and the provider's own forward (the
blocks' tail set to None: router_topk, moe_forward, the per-expert int4_ffn, the weighted sum, add_rms_norm). One
process, so both sides share the host's moment; each round's load average beside it. The logits of the two sides
are compared too (they must be equal, bit for bit).

  PYTHONPATH=$PWD python3 bench/probes/moe_tail_ab.py MODEL_DIR STORE_DIR [--rounds 10] [--steps 30] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("store", type=Path)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch
    from bench.quant_demo_speed import RECIPE
    from bench.archive.smollm2_demo_speed import PROMPT
    from transformers import AutoTokenizer
    from engine.llm import LLM
    recipe = json.loads(RECIPE.read_text())
    serve = recipe["steps"]["serve"]["args"]
    tok = AutoTokenizer.from_pretrained(args.model)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    ms = {"native MoE half": [], "provider forward": []}
    loads, equal = [], True
    with LLM.load(args.model, args.store, max_context=int(serve[serve.index("--ctx") + 1]),
                  max_batch=recipe["serve"]["max_batch_size"], ram_slots=int(serve[serve.index("--ram-slots") + 1]),
                  threads=2) as llm, torch.inference_mode():
        m, n = llm.model, len(prompt)
        tails = [layer.mlp.tail for layer in m.layers]
        assert all(t is not None for t in tails), "this model's blocks have no native MoE half"
        m.prefill(prompt, 0)
        for i in range(5):                       # warm: the first steps pay allocations and the tier's misses
            m.decode_step([5], [0], [n + i])
        for _ in range(args.rounds):
            loads.append(round(os.getloadavg()[0], 2))
            logits = {}
            for side in ms:
                for layer, t in zip(m.layers, tails):
                    layer.mlp.tail = t if side == "native MoE half" else None
                t0 = time.perf_counter()
                for i in range(args.steps):
                    out = m.decode_step([5], [0], [n + 5 + i])
                ms[side].append(round((time.perf_counter() - t0) / args.steps * 1e3, 2))
                logits[side] = out
            equal &= torch.equal(*logits.values())
        for layer, t in zip(m.layers, tails):
            layer.mlp.tail = t
    med = {k: statistics.median(v) for k, v in ms.items()}
    paired = [b / a for a, b in zip(ms["native MoE half"], ms["provider forward"])]
    res = {"what": __doc__.strip().splitlines()[0], "command": "python3 bench/probes/moe_tail_ab.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "steps_per_round": args.steps, "step_ms_rounds": ms,
           "step_ms_median": med, "provider_over_native_paired_median": round(statistics.median(paired), 3),
           "last_logits_equal_every_round": equal, "loadavg_1m_per_round": loads}
    print("| side | step ms (rounds) | median |\n|---|---|---:|")
    for k, v in ms.items():
        print(f"| {k} | {', '.join(f'{x:.1f}' for x in v)} | {med[k]:.2f} |")
    print(f"paired ratio (provider / native) median {res['provider_over_native_paired_median']}; logits equal: {equal}; "
          f"load {min(loads)}-{max(loads)}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()

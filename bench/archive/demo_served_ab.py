"""The CPU demo served by two engine trees and llama-server at once, rounds interleaved: where a served token goes.

  python3 bench/demo_served_ab.py --tree-a /work/main --rounds 5 --tokens 64 --out bench/results/DATE-demo-served-ab.json

quant_demo_speed.py --direct's measure (the same servers, prompt, tokens, client and figures: engine serve as the
recipe serves the demo's q4_1 store, llama-server on the same GGUF, each round streamed as the speed gate streams
one, tool.checks.speed.time_stream), with THREE servers up at once: `engine serve` from --tree-a (e.g. main, the
tree before a change), from this tree ("b"), and llama-server; each round streams engine a, engine b, llama.cpp
in turn, so a before/after pair and the baseline meet the same host load. Beside each engine round, from
/proc/PID/task: every thread's CPU time and context switches per streamed token (the event loop's, the scheduler's,
the OpenMP worker's). Each engine runs under a wrapper that times its scheduler's decode steps (LLM._step, start
and end on the host's monotonic clock, written at exit): per round, the median step and the median gap between
one step's end and the next one's start, the served token's cost outside the model. Each round begins with an
in-process decode of this tree (a fresh process, LLM.load as the recipe serves, LLM.stream of the same prompt,
timed first token to last, its steps timed the same way): the decode without a server. Medians, ratios per
round pair. --corunner N keeps N busy processes running through the rounds. The model and store are
quant_demo_speed's (--workdir, prepared there if missing).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
from bench.quant_demo_speed import GGUF_NAME, RECIPE, prepare, serve_args, vm
from bench.harness import tree_commit, wait_ready


def threads_of(pid: int) -> dict[str, dict]:
    """tid → name, CPU seconds, voluntary and involuntary context switches, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            st = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
        except OSError:
            continue
        f = st[st.rindex(")") + 2:].split()
        sw = {line.split(":")[0]: int(line.split()[1]) for line in status if "ctxt_switches" in line}
        out[tid] = {"name": st[st.index("(") + 1:st.rindex(")")], "cpu_s": (int(f[11]) + int(f[12])) / tick,
                    "vol": sw.get("voluntary_ctxt_switches", 0), "invol": sw.get("nonvoluntary_ctxt_switches", 0)}
    return out


def per_token(before: dict, after: dict, n: int, main_tid: str) -> list[dict]:
    """Each thread that ran during the stream: CPU ms and context switches per token (the process's main thread is
    uvicorn's event loop; Python names the others)."""
    rows = []
    for tid, a in after.items():
        b = before.get(tid, {"cpu_s": 0.0, "vol": 0, "invol": 0})
        cpu, vol, invol = a["cpu_s"] - b["cpu_s"], a["vol"] - b["vol"], a["invol"] - b["invol"]
        if cpu > 0 or vol > n // 4:
            rows.append({"tid": tid, "thread": "event loop (main)" if tid == main_tid else a["name"],
                         "cpu_ms_per_token": round(cpu / n * 1e3, 3), "voluntary_switches_per_token": round(vol / n, 2),
                         "involuntary_switches_per_token": round(invol / n, 2)})
    return sorted(rows, key=lambda r: -r["cpu_ms_per_token"])


# LLM._step timed (perf_counter: CLOCK_MONOTONIC, the bench's clock too), the times written to $KILN_STEP_TRACE at
# exit; then the rest of argv run as the `engine` command (engine serve) or, for "inprocess", the in-process decode.
TRACED = """
import atexit, json, os, sys, time
import engine.llm as L
rec, orig = [], L.LLM._step
marks = {"deliver": [], "hand_out": [], "written": []}
def _step(self, batch):
    t = time.perf_counter(); r = orig(self, batch); rec.append((t, time.perf_counter())); return r
L.LLM._step = _step
def stamp(name, fn, after=False):    # fn, its call's time (start, or end: after) appended to marks[name]
    def timed(*a, **k):
        if not after:
            marks[name].append(time.perf_counter())
        r = fn(*a, **k)
        if after:
            marks[name].append(time.perf_counter())
        return r
    return timed
if sys.argv[1] == "serve":          # the scheduler's hand-off, the loop's pick-up, each write to a socket done
    import asyncio.selector_events as se
    from engine.server import generation as G
    G.Courier.deliver = stamp("deliver", G.Courier.deliver)
    G.Courier._hand_out = stamp("hand_out", G.Courier._hand_out)
    se._SelectorSocketTransport.write = stamp("written", se._SelectorSocketTransport.write, after=True)
dump = lambda *a: open(os.environ["KILN_STEP_TRACE"], "w").write(json.dumps({"steps": rec, **marks}))
atexit.register(dump)
import signal   # uvicorn re-raises the SIGTERM it shut down on, with the handler it found: this one
signal.signal(signal.SIGTERM, lambda *a: (dump(), sys.exit(0)))
if sys.argv[1] == "inprocess":
    from transformers import AutoTokenizer
    from tool.checks.speed import MESSAGES
    model, store, ctx, batch, slots, n = sys.argv[2:8]
    ids = AutoTokenizer.from_pretrained(model).apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    with L.LLM.load(model, store, max_context=int(ctx), max_batch=int(batch), ram_slots=int(slots)) as llm:
        list(llm.stream(ids, L.SamplingParams(max_tokens=8, ignore_eos=True)))       # warm-up, as the servers get
        rec.clear()
        ts = [time.perf_counter() for _ in llm.stream(ids, L.SamplingParams(max_tokens=int(n), ignore_eos=True))]
    print(json.dumps({"decode_tps": (len(ts) - 1) / (ts[-1] - ts[0]), "tokens": len(ts)}))
else:
    from engine.cli import entry
    sys.argv = ["engine", *sys.argv[1:]]
    entry()
"""


def steps_between(trace: dict, t0: float, t1: float) -> dict:
    """The decode steps timed within [t0, t1]: median step and median gap from a step's end to the next start; served,
    the token's way out after each step (medians, ms): step end → the scheduler's hand-off to the loop (sampling,
    emitting), → the loop picking it up (its wake-up), → the SSE chunk written to the socket (the loop's work), and
    the next step's start relative to that write (negative: the step began before the token was out)."""
    rows = [(a, b) for a, b in trace["steps"] if t0 <= a and b <= t1]
    if len(rows) < 3:
        return {}
    gaps = [rows[i + 1][0] - rows[i][1] for i in range(len(rows) - 1)]
    out = {"steps": len(rows), "step_ms_median": round(statistics.median(b - a for a, b in rows) * 1e3, 3),
           "gap_ms_median": round(statistics.median(gaps) * 1e3, 3)}
    if trace.get("deliver"):
        import bisect
        first = lambda xs, t: xs[i] if (i := bisect.bisect_left(xs, t)) < len(xs) else None  # noqa: E731
        parts: dict[str, list[float]] = {k: [] for k in ("emit_ms", "loop_wake_ms", "loop_work_ms", "next_step_after_write_ms")}
        for (_, end), (nxt, _) in zip(rows, rows[1:]):
            d = first(trace["deliver"], end)
            h = first(trace["hand_out"], d) if d is not None else None
            w = first(trace["written"], h) if h is not None else None
            if w is None or w > nxt + 0.5:
                continue
            for k, v in zip(parts, (d - end, h - d, w - h, nxt - w)):
                parts[k].append(v * 1e3)
        out.update({k: round(statistics.median(v), 3) for k, v in parts.items() if v})
    return out


def inprocess_round(tree: Path, model: Path, store: Path, tokens: int, trace: Path) -> dict:
    recipe = json.loads(RECIPE.read_text())
    args = recipe["steps"]["serve"]["args"]
    r = subprocess.run([sys.executable, "-c", TRACED, "inprocess", str(model), str(store), args[args.index("--ctx") + 1],
                        str(recipe["serve"]["max_batch_size"]), args[args.index("--ram-slots") + 1], str(tokens)],
                       cwd=tree, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)]),
                                      "KILN_STEP_TRACE": str(trace)}, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"in-process decode failed: {r.stderr[-1500:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return {"decode_tps": round(got["decode_tps"], 2), "tokens": got["tokens"],
            **steps_between(json.loads(trace.read_text()), 0.0, float("inf"))}


def start_engine(tree: Path, model: Path, store: Path, log: Path, trace: Path) -> tuple[subprocess.Popen, str]:
    from tool.checks.llama_cpp import free_port
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "KILN_STEP_TRACE": str(trace)}
    proc = subprocess.Popen([sys.executable, "-c", TRACED, *serve_args(model, store, port)], cwd=tree, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_ready(proc, f"http://127.0.0.1:{port}", Path(str(log)), str(tree), limit_s=900)
    return proc, f"http://127.0.0.1:{port}"


def engine_imports_from(tree: Path) -> str:
    """Where `python -m engine` run as start_engine runs it (cwd and PYTHONPATH the tree) imports engine from."""
    return subprocess.run([sys.executable, "-c", "import engine.llm; print(engine.llm.__file__)"], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree-a", type=Path, required=True, help="the other checkout (e.g. main before the change)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kiln-quant-demo"))
    ap.add_argument("--llama-server", type=Path, default=REPO / ".kiln/cache/llama.cpp/bin/llama-server")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-inprocess", action="store_true", help="skip the in-process decode each round")
    ap.add_argument("--corunner", type=int, default=0,
                    help="N busy processes (`while True: pass`) running through the timed rounds: a third runnable "
                         "thread on the compute threads' cores, on purpose")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from tool.checks import hostload
    from tool.checks.client import Client
    from tool.checks.llama_cpp import LlamaServerProcess
    from tool.checks.speed import MESSAGES, time_stream
    gguf = REPO / ".kiln/cache/smollm2" / GGUF_NAME
    paths = prepare(gguf, args.workdir, ["q4_1"])
    recipe = json.loads(RECIPE.read_text())
    served, ctx = recipe["serve"]["served_name"], recipe["serve"]["context"]
    trees = {"engine a": args.tree_a.resolve(), "engine b": REPO}
    out = {"what": __doc__.strip().splitlines()[0], "command": "python3 bench/demo_served_ab.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
           "trees": {k: {"path": str(t), "commit": tree_commit(t)} for k, t in trees.items()}, "tokens": args.tokens,
           "note": "threads per token: the event loop is the server's main thread; of the two busiest `python` "
                   "threads one is the engine's scheduler (the OpenMP master) and one libgomp's worker"}
    procs, clients, mains = {}, {}, {}
    traces = {side: args.workdir / f"ab-{side.replace(' ', '-')}-steps.json" for side in trees}
    llama = LlamaServerProcess(args.llama_server, gguf, ctx=ctx, alias=served)
    try:
        for side, tree in trees.items():
            log = args.workdir / f"ab-{side.replace(' ', '-')}.log"
            procs[side], url = start_engine(tree, paths["model"], paths["q4_1"], log, traces[side])
            clients[side] = Client(url + "/v1", timeout_s=600)
            mains[side] = str(procs[side].pid)
            out["trees"][side]["engine_imported_from"] = engine_imports_from(tree)
        llama.start()
        clients["llama.cpp"] = Client(llama.url, timeout_s=600)
        out["llama_server_argv"] = llama.argv
        body = {"model": served, "messages": MESSAGES, "max_tokens": args.tokens, "temperature": 0.0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        for c in clients.values():               # untimed warm-up, as the gate gives one
            c.chat({k: v for k, v in body.items() if k != "stream_options"} | {"max_tokens": 8})
        corunners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.corunner)]
        out["corunners"] = args.corunner
        got: dict[str, list[dict]] = {k: [] for k in ["in-process b", *clients]}
        spans: dict[str, list[tuple[float, float]]] = {k: [] for k in procs}
        for _ in range(args.rounds):
            if not args.no_inprocess:
                load = round(os.getloadavg()[0], 2)
                got["in-process b"].append({**inprocess_round(REPO, paths["model"], paths["q4_1"], args.tokens,
                                                              args.workdir / "ab-inprocess-steps.json"), "loadavg_1m": load})
                print(f"  in-process b {got['in-process b'][-1]}", file=sys.stderr, flush=True)
            for side, c in clients.items():
                s0 = time.perf_counter()
                pid = procs[side].pid if side in procs else None
                t0 = threads_of(pid) if pid else None
                h0 = hostload.snapshot()
                ans = c.stream_chat(body)
                h = hostload.between(h0, hostload.snapshot())
                timed = time_stream(ans)
                row = {"decode_tps": round(timed[0], 2) if timed else None, "tokens": timed[1] if timed else None,
                       "ttft_s": ans.ttft_s, "loadavg_1m": h["loadavg"][0] if h["loadavg"] else None,
                       "cpu_pressure_some": h["cpu_pressure_some"]}
                if pid:
                    row["threads"] = per_token(t0, threads_of(pid), args.tokens, mains[side])
                    spans[side].append((s0, time.perf_counter()))
                got[side].append(row)
                print(f"  {side:9} {row['decode_tps']} tok/s  load {row['loadavg_1m']}  "
                      + ("  ".join(f"{t['thread'][:10]} {t['cpu_ms_per_token']}ms/{t['voluntary_switches_per_token']}sw"
                                   for t in row.get("threads", [])[:3])), file=sys.stderr, flush=True)
        for p in corunners:
            p.kill()
            p.wait()
        rss = {k: vm(p.pid, "VmHWM") for k, p in procs.items()}
        for p in procs.values():                 # the step traces are written at exit
            p.terminate()
            p.wait(60)
        for side in procs:
            trace = json.loads(traces[side].read_text())
            for row, (s0, s1) in zip(got[side], spans[side]):
                row.update(steps_between(trace, s0, s1))
        got = {k: v for k, v in got.items() if v}
        med = {k: statistics.median(r["decode_tps"] for r in v if r["decode_tps"]) for k, v in got.items()}
        step_med = {k: {m: statistics.median(r[m] for r in v if m in r) for m in
                        ("step_ms_median", "gap_ms_median", "emit_ms", "loop_wake_ms", "loop_work_ms",
                         "next_step_after_write_ms") if any(m in r for r in v)}
                    for k, v in got.items() if k != "llama.cpp" and any("step_ms_median" in r for r in v)}
        pair = lambda a, b: [round(x["decode_tps"] / y["decode_tps"], 3) for x, y in zip(got[a], got[b])]  # noqa: E731
        loop_ms = {k: statistics.median(next((t["cpu_ms_per_token"] for t in r["threads"] if t["thread"].startswith("event loop")), 0.0)
                                        for r in got[k]) for k in procs}
        loop_sw = {k: statistics.median(next((t["voluntary_switches_per_token"] for t in r["threads"] if t["thread"].startswith("event loop")), 0.0)
                                        for r in got[k]) for k in procs}
        out.update(rounds=got, median_decode_tps=med, median_of_rounds_step_and_gap=step_med,
                   vs_llama_cpp={k: round(med[k] / med["llama.cpp"], 3) for k in med if k != "llama.cpp"},
                   b_over_a=round(med["engine b"] / med["engine a"], 3),
                   per_round_ratio_vs_llama_cpp={k: pair(k, "llama.cpp") for k in procs},
                   median_event_loop_cpu_ms_per_token=loop_ms, median_event_loop_voluntary_switches_per_token=loop_sw,
                   engine_rss_peak_bytes=rss)
        args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(json.dumps({k: out[k] for k in ("median_decode_tps", "vs_llama_cpp", "b_over_a", "median_of_rounds_step_and_gap",
                                                "median_event_loop_cpu_ms_per_token",
                                                "median_event_loop_voluntary_switches_per_token")}, indent=2))
    finally:
        llama.stop()
        llama.remove_log()
        for p in procs.values():
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()

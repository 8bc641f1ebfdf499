"""Does llama.cpp's `glm5-next` compute GLM-5.3-Flash's function? llama-server against Kiln's exact glm5_next and
transformers' glm5_next on the same tokens, on small random checkpoints converted by llama.cpp's own converter.

  python -m bench.glm5_next_llama_cpp --work /tmp/g5 [--llama-cpp .kiln/cache/llama.cpp] [--out bench/results/X.json]

For each variant (a tiny transformers glm5_next checkpoint: KDA and DSA layers, a full and a shared indexer, a dense
and MoE layers, 4 mHC streams; engine's tests/fixtures make it), scripts/glm5_next_gguf.py writes the published
flat form and converts it with llama.cpp's convert_hf_to_gguf.py (F32; Q8_0 and Q4_K_M by llama-quantize). Then, on
one random token sequence (prompt of --prompt tokens, then --positions teacher-forced ones):
  - transformers: its uncached forward of the whole sequence (the definition, as in tests/engine/test_glm5_next.py);
  - Kiln exact: the checkpoint, prefill of the whole sequence; its greedy continuation of the prompt (cached decode);
  - Kiln on the GGUF: the same from the converted F32 file (was the conversion faithful?);
  - llama-server (CPU, loopback) on the same file: teacher-forced top-n_probs logprobs at every position (one
    /completion each, no prompt cache: an uncached forward of the prefix), and its greedy continuation.
Figures: top-1 agreement and max |Δ logprob| over llama.cpp's top-10 tokens at each position; greedy tokens equal.

Variants: `base` (its file also quantized, Q8_0 and Q4_K_M, each side run on the same quantized file);
`all-pools` (index_topk covers every pool: the indexer's choice cannot matter); `kda-silenced`/`dsa-silenced` (one
kind's attention output zeroed in the flat form). The last three localise a disagreement where there is one.
The two conversion findings of the earlier trial are checked directly: the flat form with
`linear_attn_config.gate_lower_bound: null` (converter output lacks `kda.gate_lower_bound`?) and a one-kind model
(llama.cpp refuses it?).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch

from bench.harness import REPO, RESULTS, add_to_index, host_load, index_row, log, table, write_result
from tool.checks.llama_cpp import LlamaServerProcess

SCRIPT = REPO / "scripts" / "glm5_next_gguf.py"
TOPN = 10
BASE = dict(hidden=256, n_group=1, topk_group=1)
# name -> (make_tiny_glm5_next keywords, layers whose attention output is zeroed in the flat form before converting)
VARIANTS = {
    "base": (BASE, ()),
    "all-pools": ({**BASE, "index_topk": 1024}, ()),
    "kda-silenced": (BASE, (0, 3)),        # the KDA layers' o_proj zero: only DSA attention (and the rest) count
    "dsa-silenced": (BASE, (1, 2, 4)),     # the DSA layers' o_proj zero: only KDA attention counts
}


def convert(ckpt: Path, out: Path, llama_cpp: Path, types: str) -> dict[str, Path]:
    r = subprocess.run([sys.executable, str(SCRIPT), str(ckpt), str(out), "--llama-cpp", str(llama_cpp),
                        "--types", types], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"glm5_next_gguf failed: {r.stderr.strip()[-800:]}")
    return {t: Path(p) for t, p in json.loads(r.stdout).items()}


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def first_top(base: str, prefix: list[int]) -> dict[int, float]:
    """llama-server's top-N logprobs of the token after `prefix` (an uncached forward: no prompt cache).

    This llama-server drops a token's probabilities where the token is held back inside an incomplete UTF-8
    sequence (the stand-in vocabulary's byte tokens), and then completion_probabilities[0] is the NEXT token's
    (seen: tokens [165, 19, …], probabilities listed first for 19); with n_predict 1 it lists none. So the entry is
    read only where its `id` is the first sampled token; else that token is banned by logit_bias (a sampler: the
    pre-sampling logprobs reported are unchanged) and the request repeated, until the first token is one it lists."""
    bias: list[list] = []
    for _ in range(12):
        r = post(f"{base}/completion", {"prompt": prefix, "n_predict": 2, "n_probs": TOPN, "temperature": 0,
                                        "cache_prompt": False, "ignore_eos": True, "return_tokens": True,
                                        "logit_bias": bias})
        probs, toks = r.get("completion_probabilities") or [], r.get("tokens") or []
        if probs and toks and int(probs[0]["id"]) == int(toks[0]):
            return {int(t["id"]): float(t["logprob"]) for t in probs[0]["top_logprobs"]}
        if not toks:
            raise RuntimeError(f"llama-server returned no tokens after {len(prefix)} tokens")
        bias.append([int(toks[0]), False])
    raise RuntimeError(f"llama-server gave no aligned completion_probabilities after {len(prefix)} tokens")


def llama_side(exe: Path, gguf: Path, seq: list[int], prompt: int, steps: int) -> dict:
    """llama-server's teacher-forced top-N logprobs after each prefix seq[:i+1], i in [prompt-1, len-1), and its
    greedy continuation of seq[:prompt]."""
    srv = LlamaServerProcess(exe, gguf, ctx=512, threads=2).start()
    try:
        base = srv.url.removesuffix("/v1")
        forced = []
        for i in range(prompt - 1, len(seq) - 1):
            forced.append(first_top(base, seq[:i + 1]))
        # a few tokens past `steps`: the tokens of a trailing incomplete UTF-8 sequence are held back
        r = post(f"{base}/completion", {"prompt": seq[:prompt], "n_predict": steps + 8, "temperature": 0, "top_k": 1,
                                        "cache_prompt": False, "ignore_eos": True, "return_tokens": True})
        return {"forced": forced, "greedy": [int(t) for t in r["tokens"]][:steps]}
    finally:
        srv.stop()


def kiln_side(model_path, seq: list[int], prompt: int, steps: int) -> dict:
    from engine.loader import load_model
    m = load_model(model_path, max_context=256, max_batch=2)
    with torch.inference_mode():
        logp = torch.log_softmax(m.prefill(seq, 0, all_logits=True).float(), -1)
        out = [int(m.prefill(seq[:prompt], 1).argmax())]
        for i in range(steps - 1):
            out.append(int(m.decode_step([out[-1]], [1], [prompt + i])[0].argmax()))
    return {"logp": logp, "greedy": out}


def transformers_side(ckpt: Path, seq: list[int]) -> torch.Tensor:
    from transformers import Glm5NextForConditionalGeneration
    ref = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(ref(torch.tensor([seq])).logits[0].float(), -1)


def vs_full(a: torch.Tensor, b: torch.Tensor, prompt: int) -> dict:
    """Two full log-prob tables at the teacher-forced positions: top-1 agreement, max |Δ| over a's top-N."""
    a, b = a[prompt - 1:-1], b[prompt - 1:-1]
    top = a.topk(TOPN, -1).indices
    return {"positions": a.shape[0], "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "max_abs_dlogprob_topn": float((a.gather(1, top) - b.gather(1, top)).abs().max())}


def vs_llama(kiln: torch.Tensor, forced: list[dict], prompt: int) -> dict:
    k = kiln[prompt - 1:-1]
    agree, first, per = 0, None, []
    for i, row in enumerate(forced):
        lt = max(row, key=row.get)
        same = lt == int(k[i].argmax())
        agree += same
        if not same and first is None:
            first = i
        per.append(round(max(abs(lp - float(k[i, t])) for t, lp in row.items()), 5))
    off = [prompt + i for i, d in enumerate(per) if d > 1e-3]
    return {"positions": len(forced), "top1_agree": agree / len(forced), "max_abs_dlogprob_topn": max(per),
            "first_top1_disagreement": first, "per_position_max_abs_dlogprob": per,
            "prefix_lengths_off_by_1e-3": off}


def greedy_cmp(a: list[int], b: list[int]) -> dict:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return {"equal": a == b, "first_divergence": first, "steps": len(a)}


def silence(flat: Path, out: Path, layers) -> Path:
    """A copy of the flat form with the attention output (o_proj) of `layers` zero."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(flat, out)
    w = load_file(out / "model.safetensors")
    for l in layers:
        w[f"model.layers.{l}.self_attn.o_proj.weight"].zero_()
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    return out


def lower_bound_null(ckpt: Path, work: Path, llama_cpp: Path) -> dict:
    """The published flat form with linear_attn_config.gate_lower_bound null: does the converter's file say it?"""
    import importlib.util
    spec = importlib.util.spec_from_file_location("glm5_next_gguf", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    flat = mod.flatten(ckpt, work / "null-flat")
    cfg = json.loads((flat / "config.json").read_text())
    cfg["linear_attn_config"]["gate_lower_bound"] = None
    (flat / "config.json").write_text(json.dumps(cfg))
    out = mod.convert(flat, work / "null.gguf", llama_cpp)
    from gguf import GGUFReader
    keys = set(GGUFReader(out).fields)
    from engine.glm5_next_config import Glm5Spec
    return {"kda.gate_lower_bound_in_file": "glm5-next.kda.gate_lower_bound" in keys,
            "kiln_spec_lower_bound_from_flat_config": Glm5Spec.from_config(cfg).lower_bound}


def one_kind(work: Path, llama_cpp: Path, exe: Path) -> dict:
    """A model whose layers are all KDA: llama-server's answer (does it load?)."""
    from tests.fixtures.tiny_models import make_tiny_glm5_next
    ck = make_tiny_glm5_next(work / "kda-only-ck", n_group=1, topk_group=1, layer_types=["linear_attention"] * 3,
                             indexer_types=["full"] * 3, mlp_layer_types=["dense", "sparse", "sparse"])
    f = convert(ck, work / "kda-only", llama_cpp, "F32")["F32"]
    try:
        srv = LlamaServerProcess(exe, f, ctx=256, threads=2).start(ready_timeout_s=120)
        srv.stop()
        return {"llama_server_loads": True}
    except Exception as e:          # noqa: BLE001  (the finding is the failure's words)
        return {"llama_server_loads": False, "error": str(e)[-300:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--llama-cpp", type=Path, default=REPO / ".kiln" / "cache" / "llama.cpp")
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--positions", type=int, default=48)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path, default=RESULTS / "glm5-next-llama-cpp.json")
    ap.add_argument("--index", action="store_true", help="add the result's row to bench/results/index.jsonl")
    a = ap.parse_args()
    from tests.fixtures.tiny_models import make_tiny_glm5_next
    torch.set_num_threads(2)
    exe = a.llama_cpp / "bin" / "llama-server"
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    gen = torch.Generator().manual_seed(11)
    seq = torch.randint(20, 384, (a.prompt + a.positions,), generator=gen).tolist()
    load0, doc = host_load(), {"prompt_tokens": a.prompt, "positions": a.positions, "greedy_steps": a.steps,
                               "top_n": TOPN, "sequence": seq, "variants": {}}
    rows = []
    for name in a.variants.split(","):
        kw, silenced = VARIANTS[name]
        ck = make_tiny_glm5_next(a.work / f"{name}-ck", **kw)
        files = convert(ck, a.work / name, a.llama_cpp, "F32,Q8_0,Q4_K_M" if name == "base" else "F32")
        ref = None
        if silenced:          # ablation: Kiln's exact model reads the edited flat form; transformers has none
            ck = silence(files["F32"].parent / "flat", a.work / f"{name}-flat", silenced)
            files = convert(ck, a.work / f"{name}-silenced", a.llama_cpp, "F32")
        else:
            ref = transformers_side(ck, seq)
        log(f"{name}: converted {', '.join(files)}")
        exact = kiln_side(ck, seq, a.prompt, a.steps)
        v = {"config": kw, "silenced_attention_layers": list(silenced), "files": {t: str(p) for t, p in files.items()}}
        if ref is not None:
            v["kiln_vs_transformers"] = vs_full(exact["logp"], ref, a.prompt)
        v["kiln_greedy"] = exact["greedy"]
        for t, f in files.items():
            on_file = kiln_side(f, seq, a.prompt, a.steps)
            ll = llama_side(exe, f, seq, a.prompt, a.steps)
            v[t] = {"kiln_gguf_vs_kiln_checkpoint": vs_full(on_file["logp"], exact["logp"], a.prompt),
                    "kiln_gguf_greedy_vs_checkpoint": greedy_cmp(on_file["greedy"], exact["greedy"]),
                    "llama_vs_kiln_gguf": vs_llama(on_file["logp"], ll["forced"], a.prompt),
                    "llama_vs_kiln_checkpoint": vs_llama(exact["logp"], ll["forced"], a.prompt),
                    "llama_vs_transformers": vs_llama(ref, ll["forced"], a.prompt) if ref is not None else None,
                    "llama_greedy": ll["greedy"],
                    "llama_greedy_vs_kiln_gguf": greedy_cmp(ll["greedy"], on_file["greedy"]),
                    "llama_greedy_vs_kiln_checkpoint": greedy_cmp(ll["greedy"], exact["greedy"])}
            r = v[t]
            rows.append({"variant": name, "file": t,
                         "kiln_gguf_vs_ckpt_max_dlogp": f"{r['kiln_gguf_vs_kiln_checkpoint']['max_abs_dlogprob_topn']:.2e}",
                         "llama_vs_kiln_top1": f"{r['llama_vs_kiln_checkpoint']['top1_agree']:.3f}",
                         "llama_vs_kiln_max_dlogp": f"{r['llama_vs_kiln_checkpoint']['max_abs_dlogprob_topn']:.3f}",
                         "llama_vs_hf_top1": f"{r['llama_vs_transformers']['top1_agree']:.3f}" if ref is not None else "-",
                         "greedy_llama_eq_kiln": r["llama_greedy_vs_kiln_checkpoint"]["equal"],
                         "greedy_first_div": r["llama_greedy_vs_kiln_checkpoint"]["first_divergence"]})
            log(json.dumps(rows[-1]))
        doc["variants"][name] = v
    base_ck = a.work / "base-ck"
    if base_ck.exists():
        doc["gate_lower_bound_null"] = lower_bound_null(base_ck, a.work, a.llama_cpp)
    doc["one_layer_kind"] = one_kind(a.work, a.llama_cpp, exe)
    doc["host_load"] = {"start": load0, "end": host_load()}
    table(rows, list(rows[0]))
    path = write_result(a.out, doc)
    log(f"wrote {path}")
    if a.index:
        b = doc["variants"].get("base", {}).get("F32", {})
        add_to_index(index_row(path, {
            "llama_vs_kiln_top1_f32": b.get("llama_vs_kiln_checkpoint", {}).get("top1_agree"),
            "llama_vs_kiln_max_dlogprob_f32": b.get("llama_vs_kiln_checkpoint", {}).get("max_abs_dlogprob_topn"),
            "kiln_gguf_vs_checkpoint_max_dlogprob_f32":
                b.get("kiln_gguf_vs_kiln_checkpoint", {}).get("max_abs_dlogprob_topn")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kiln against llama.cpp on the same GGUF file, made by llama.cpp's own tools (issue 29, "Verified against
llama.cpp, on the same files"). bench/gguf_files.py and bench/gguf_agreement.py run it over the demo and random
checkpoints; tests/engine/test_gguf_llama_agreement.py runs it on one small file.

  make the files   random_moe_checkpoint (a random qwen3_moe / glm4_moe with a tokenizer llama.cpp's converter
                   knows), convert_hf (llama.cpp's convert_hf_to_gguf.py, F32), quantize (llama-quantize)
  llama's side     llama_topn: llama-server's top-N log-probabilities at every position of a token sequence,
                   teacher-forced: one /completion request per position (prompt = the tokens so far, one token
                   predicted, n_probs N); its prompt cache keeps the prefix, so each request evaluates one token
                   (llama-server has no prompt log-probabilities, `echo`)
                   llama_full: the same with n_probs the vocabulary (llama-server lists every token): exact KL
  Kiln's side      kiln_prompt_topn: `engine serve --model FILE.gguf`'s top-20 at every position over HTTP, the
                   prompt's logprobs (/v1/completions, echo, max_tokens 0), as a client asks; kiln_logprobs: the
                   full distribution in-process (LLM.load on the GGUF alone, the object the server serves), which
                   an exact KL needs and the API (top-20 at most) cannot give; compare_served holds the two equal
  compare          compare_full (two full distributions: top-1 agreement, exact KL) and compare_topn (a top-N
                   side against a full one: KL over the N tokens and one bin for the rest, a LOWER BOUND of the
                   full KL: merging outcomes never raises KL)

The llama.cpp tree is scripts/build-llama-cpp.sh's (bin/llama-quantize, convert_hf_to_gguf.py with its gguf-py/
and conversion/): $KILN_LLAMA_CPP_DIR, else .kiln/cache/llama.cpp in this checkout.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.synth import randomize_skewed

REPO = Path(__file__).resolve().parents[2]
# The six gates' prompts (tool/checks: load, chat, reasoning, tools, speed; context's needle question, without its
# fill of thousands of tokens), asked as the gates ask: one user turn through the model's chat template.
GATE_PROMPTS = {
    "load": "Hi",
    "chat": "Name three primary colors, comma separated.",
    "reasoning": "What is 17 * 23? Reply with only the number.",
    "tools": "What's the weather in Paris right now? Use the tool.",
    "speed": "Write a 600-word story about a lighthouse keeper who finds a message in a bottle.",
    "context": "What is the secret code mentioned in the text above? Reply with the code only.",
}


GLM_SPECIALS = ("[gMASK]", "<|user|>", "<|observation|>")


class ToolFailed(RuntimeError):
    """A llama.cpp tool exited non-zero (its output's tail in the message)."""


def llama_cpp_dir() -> Path:
    return Path(os.environ.get("KILN_LLAMA_CPP_DIR") or REPO / ".kiln" / "cache" / "llama.cpp")


def quantize_bin() -> Path:
    return llama_cpp_dir() / "bin" / "llama-quantize"


def converter() -> Path:
    return llama_cpp_dir() / "convert_hf_to_gguf.py"


def _run(argv: list[str], timeout: float, env: dict | None = None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise ToolFailed(f"{Path(argv[1] if argv[0] == sys.executable else argv[0]).name} exited {r.returncode}: "
                         f"{(r.stdout + r.stderr)[-2000:]}")
    return r.stdout + r.stderr


def convert_hf(ckpt: str | os.PathLike, out: str | os.PathLike, outtype: str = "f32", timeout: float = 1800) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on a transformers checkpoint: an `outtype` GGUF at `out`. It runs with
    this Python, its own gguf-py first on the path (the converter and its gguf package are one release)."""
    d = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(d / "gguf-py"), str(d),
                                                       *filter(None, [os.environ.get("PYTHONPATH")])]),
           "NO_LOCAL_GGUF": ""}
    _run([sys.executable, str(converter()), str(ckpt), "--outtype", outtype, "--outfile", str(out)], timeout, env)
    return Path(out)


def quantize(src: str | os.PathLike, dst: str | os.PathLike, qtype: str, threads: int = 2,
         timeout: float = 1800) -> Path:
    """llama-quantize SRC DST QTYPE: the mix llama.cpp makes of that name (Q4_K_M's Q6_K downs in some layers,
    its fallbacks where a row is no multiple of 256 ...)."""
    _run([str(quantize_bin()), str(src), str(dst), qtype, str(threads)], timeout)
    return Path(dst)


def tensor_types(path: str | os.PathLike) -> dict[str, int]:
    """How many tensors of each GGML type the file holds."""
    from gguf import GGUFReader
    out: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
    return dict(sorted(out.items()))


# ------------------------------------------------------------------ random checkpoints

def tokenizer_from_gguf(gguf: str | os.PathLike, out: str | os.PathLike):
    """The tokenizer a GGUF carries (transformers' GGUF tokenizer converter), saved into `out`. The demo's SmolLM2
    gives one llama.cpp's converter knows by its pre-tokenizer hash ("smollm"), which a tokenizer trained here
    would not be."""
    from transformers import AutoTokenizer
    gguf = Path(gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tok.chat_template:
        from gguf import GGUFReader
        f = GGUFReader(str(gguf)).fields.get("tokenizer.chat_template")
        tok.chat_template = f.contents() if f is not None else None
    tok.save_pretrained(str(out))
    return tok


def random_moe_checkpoint(arch: str, out: str | os.PathLike, tokenizer_dir: str | os.PathLike, *, hidden: int = 256,
                          moe_inter: int = 256, layers: int = 3, experts: int = 8, top_k: int = 2,
                          seed: int = 0) -> Path:
    """A small random `arch` (qwen3_moe | glm4_moe) checkpoint, float32, written by transformers' save_pretrained,
    with the tokenizer in `tokenizer_dir`. Weights N(0, 0.08) (embeddings 0.5), norms near one, routers spread so
    some experts are preferred (routing far from uniform, as real routing is). glm4_moe: the first layer dense,
    one shared expert, partial rotary, q/k norms and attention biases, one expert group (as GLM-4.5's)."""
    import shutil
    import transformers as T
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = T.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if arch == "glm4_moe":          # the converter's GLM vocabulary names these special tokens (bos, eot, eom)
        tok.add_tokens(list(GLM_SPECIALS), special_tokens=True)
        tok.save_pretrained(str(out))
    else:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file():
                shutil.copy(f, out / f.name)
    common = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=8192, num_experts_per_tok=top_k,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    if arch == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=moe_inter, intermediate_size=2 * hidden,
                               norm_topk_prob=True, **common)
        cls = T.Qwen3MoeForCausalLM
    elif arch == "glm4_moe":
        cfg = T.Glm4MoeConfig(n_routed_experts=experts, moe_intermediate_size=moe_inter, intermediate_size=2 * hidden,
                              first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True, partial_rotary_factor=0.5,
                              use_qk_norm=True, attention_bias=True, **common)
        cls = T.Glm4MoeForCausalLM
    else:
        raise ValueError(f"unknown arch {arch} (qwen3_moe or glm4_moe)")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomize_skewed(model, experts, seed)
    model.save_pretrained(str(out))
    return out


def reference_logprobs(ckpt: str | os.PathLike, ids: list[int]) -> torch.Tensor:
    """The fp32 reference: transformers on the original checkpoint, every position's log-probabilities [n, vocab]."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return F.log_softmax(logits, -1)


# ------------------------------------------------------------------ the two sides

def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llama_topn(base: str, ids: list[int], n_probs: int = 20) -> list[tuple[list[int], list[float]]]:
    """llama-server (`base`: http://127.0.0.1:PORT) teacher-forced: for each k in 1..len(ids)-1, the top-N
    (token ids, log-probabilities) it gives the token after ids[:k], before sampling (post_sampling_probs false:
    a softmax of the full logits, llama.cpp's get_token_probabilities). ignore_eos: a position whose top token
    ends the text would otherwise stop before a token, and give no probabilities; its bias acts in the sampler,
    after the probabilities are read from the logits."""
    return list(llama_positions(base, ids, n_probs))


def llama_positions(base: str, ids: list[int], n_probs: int):
    """llama_topn's entries, one position at a time (a whole-vocabulary list per position is held once)."""
    for k in range(1, len(ids)):
        body = {"prompt": ids[:k], "n_predict": 1, "n_probs": n_probs, "temperature": 0, "cache_prompt": True,
                "ignore_eos": True}
        r = _post(f"{base}/completion", body)
        if not r.get("completion_probabilities"):
            # Its top token was part of a UTF-8 character: llama-server holds the text, and its probabilities,
            # until the character completes; a few more tokens release them (the first entry is this position's).
            r = _post(f"{base}/completion", {**body, "n_predict": 8})
        top = r["completion_probabilities"][0]["top_logprobs"]
        yield [int(t["id"]) for t in top], [float(t["logprob"]) for t in top]


def kiln_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """Kiln's log-probabilities at every position [n, vocab], IN-PROCESS: the model of `llm` (engine.llm.LLM,
    loaded as `engine serve` loads it) prefills the tokens whole with every position's logits, on a KV slot the idle
    scheduler does not use at the time. The API gives a top-20 (kiln_prompt_topn); this full form is what an exact
    KL needs, and compare_served checks it is what the server serves."""
    with torch.inference_mode():
        logits = llm.model.prefill(list(ids), 0, all_logits=True).float()
    return F.log_softmax(logits, -1)


def text_ids(tokenizer) -> dict[str, int | None]:
    """Each token text the API shows (engine.server.logprobs.token_text, the server's own) to its id; None where two
    ids show as one text (partial UTF-8 characters, both U+FFFD)."""
    from engine.server.logprobs import token_text
    text = token_text(tokenizer)
    out: dict[str, int | None] = {}
    for i in range(len(tokenizer)):
        s = text(i)[0]
        out[s] = None if s in out else i
    return out


UNKNOWN = -1     # an id for a served token whose text two tokens share: agrees with nothing, weighs in no bin


def kiln_prompt_topn(base: str, ids: list[int], n: int, texts: dict[str, int | None]) -> tuple[list, int]:
    """Kiln's top-N at every position through its HTTP API, as a client asks (`base`: http://127.0.0.1:PORT of
    `engine serve`): POST /v1/completions {prompt: ids, echo, max_tokens: 0, logprobs: n}, the prompt's logprobs
    alone. Entry k-1 is the distribution after ids[:k] (llama_topn's form). The API keys its top-N by token text;
    `texts` (text_ids) maps them back to ids, and an entry whose text two ids share gets UNKNOWN, in its place (a
    top-1 so named counts as a disagreement: top-1 agreement through the API is never overstated); returned beside:
    how many entries, over all positions, are UNKNOWN. The chosen token the API adds beyond the N is dropped."""
    r = _post(f"{base}/v1/completions", {"prompt": list(ids), "max_tokens": 0, "echo": True, "logprobs": n,
                                         "temperature": 0})
    tops = r["choices"][0]["logprobs"]["top_logprobs"]
    if len(tops) != len(ids) or tops[0] is not None:
        raise ValueError(f"prompt logprobs: {len(tops)} entries for {len(ids)} tokens")
    out, unknown = [], 0
    for top in tops[1:]:
        kept = [(texts.get(s), float(v)) for s, v in list(top.items())[:n]]
        unknown += sum(i is None for i, _ in kept)
        out.append(([UNKNOWN if i is None else i for i, _ in kept], [v for _, v in kept]))
    return out, unknown


def llama_full(base: str, ids: list[int], vocab: int) -> torch.Tensor:
    """llama-server's whole distribution at every position [len(ids)-1, vocab]: llama_topn with n_probs the
    vocabulary (llama-server lists every token when asked; measured on the 49,152-token SmolLM2: 49,152 entries,
    ~0.4 s a position), so KL against it is exact rather than a bound."""
    out = torch.full((len(ids) - 1, vocab), -math.inf, dtype=torch.float32)
    for k, (tids, lps) in enumerate(llama_positions(base, ids, vocab)):
        if len(tids) != vocab:
            raise ValueError(f"llama-server listed {len(tids)} of {vocab} tokens at position {k + 1}")
        out[k, torch.tensor(tids)] = torch.tensor(lps, dtype=torch.float32)
    return out


def greedy_llama(base: str, ids: list[int], max_tokens: int) -> str:
    r = _post(f"{base}/completion", {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False})
    return r["content"]


def greedy_kiln(base: str, ids: list[int], max_tokens: int) -> str:
    """Kiln's served answer (`base`: http://127.0.0.1:PORT of `engine serve`), greedy, from the same token ids."""
    r = _post(f"{base}/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "temperature": 0})
    return r["choices"][0]["text"]


# ------------------------------------------------------------------ figures

def compare_full(ref: torch.Tensor, other: torch.Tensor) -> dict:
    """Two full log-probability tensors [n, vocab]: top-1 agreement and mean KL(ref ‖ other) in nats (exact)."""
    n = min(len(ref), len(other))
    ref, other = ref[:n].double(), other[:n].double()
    kl = (ref.exp() * (ref - other)).sum(-1)
    return {"positions": n, "top1_agreement": round(float((ref.argmax(-1) == other.argmax(-1)).double().mean()), 4),
            "kl_mean_nats": round(float(kl.mean()), 6)}


def _binned(top_ids: list[int], top_lp: list[float], full: torch.Tensor) -> tuple[list[float], list[float]]:
    """(the top-N side's, the full side's) probabilities over the N tokens plus one bin for the rest."""
    known = [(i, x) for i, x in zip(top_ids, top_lp) if i != UNKNOWN]      # an UNKNOWN's mass stays in the rest
    p = [math.exp(x) for _, x in known]
    q = full[[i for i, _ in known]].double().exp().tolist()
    return p + [max(0.0, 1.0 - sum(p))], q + [max(0.0, 1.0 - sum(q))]


def _kl(p: list[float], q: list[float]) -> float:
    eps = 1e-300
    return sum(a * (math.log(max(a, eps)) - math.log(max(b, eps))) for a, b in zip(p, q) if a > 0)


def compare_topn(topn: list[tuple[list[int], list[float]]], full: torch.Tensor, topn_is_reference: bool) -> dict:
    """A top-N side against a full side, position by position: top-1 agreement (the top-N side's first token
    against the full side's argmax) and mean KL over the N tokens + a rest bin, KL(topN ‖ full) when the top-N side
    is the reference, else KL(full ‖ topN) -- a LOWER BOUND of the full KL."""
    n = min(len(topn), len(full))
    agree, kl = 0, 0.0
    for (ids, lps), row in zip(topn[:n], full[:n]):
        agree += int(ids[0] == int(row.argmax()))
        p, q = _binned(ids, lps, row)
        kl += _kl(p, q) if topn_is_reference else _kl(q, p)
    return {"positions": n, "top1_agreement": round(agree / n, 4), "kl_mean_nats_lower_bound": round(kl / n, 6)}


def topn_of(full: torch.Tensor, n: int) -> list[tuple[list[int], list[float]]]:
    """A full side's top-N in llama_topn's form (to bound both sides' KL over the same kind of bins)."""
    v, i = full.topk(n, -1)
    return [(a.tolist(), b.tolist()) for a, b in zip(i, v.double())]


def compare_served(served: list[tuple[list[int], list[float]]], full: torch.Tensor) -> dict:
    """The API's top-N (kiln_prompt_topn) against the in-process full distribution of the same model: the largest
    difference of a served log-probability from the in-process one, and on how many positions the served top-1 is
    the in-process argmax (an UNKNOWN top-1 is not). Equal within float noise: the in-process full form is what the
    server serves."""
    n = min(len(served), len(full))
    diff, same = 0.0, 0
    for (tids, lps), row in zip(served[:n], full[:n]):
        known = [(i, x) for i, x in zip(tids, lps) if i != UNKNOWN]
        diff = max(diff, max((abs(x - float(row[i])) for i, x in known), default=0.0))
        same += int(tids[0] == int(row.argmax()))
    return {"positions": n, "max_abs_logprob_diff": round(diff, 7), "top1_same": same}

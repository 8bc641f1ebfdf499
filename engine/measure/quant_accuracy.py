"""Quantized experts against the float model: top-1 agreement and KL over teacher-forced positions, and greedy
tokens on given prompts (bench/quant_accuracy.py runs it on SmolLM2 and a synthetic checkpoint). KL is
KL(reference || quantized) in nats, mean over positions. 4-bit records compute with the CPU's int4 kernel, as the
engine serves them; 8-bit ones with their dequantized values (what their dequantize-per-call CPU path computes)."""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from engine.checkpoint import Checkpoint
from engine.experts.layout import ExpertLayout
from engine.loader import load_model
from engine.quant.records import dequantize_matrix, quantize_int4, quantize_int8
from engine.store.source import record_source
from engine.tiers.memory import InMemoryExperts

GREEDY = 20                  # tokens decoded greedily per prompt

# Records measured. Served: the records as pack-store makes them and the CPU computes them (int8 dequantized
# per call, 4-bit through torch's int4 kernel with bf16 activations). Sweep ("scheme gN ..."): a group size
# or scale rule, its weights dequantized into fp32 records, so the grid alone is measured; "former" is the
# default before this measurement: 128 where it divides the input dimension, else 64, int8 scaled absmax/127.
SERVED = ("bf16", "int8", "int4", "q4_1")
WITH_ATTENTION_BLOCKS = "q4_1 + attention blocks"     # --attention-blocks: q4_1 records on that checkpoint
SWEEP = {"int8 former": ("int8", "former", (127,)), "int4 former": ("int4", "former", None),
         "int4 g64": ("int4", 64, None), "int8 g32 absmax": ("int8", 32, (127,)),
         "int4 g128": ("int4", 128, None), "int4 g32 fp32": ("int4", 32, None)}


def _former_group(inp: int) -> int:
    return next(g for g in (128, 64, 32) if inp % g == 0)


def sweep_matrix(spec, w: torch.Tensor) -> torch.Tensor:
    """One matrix quantized by a SWEEP spec and dequantized (float32)."""
    scheme, group, divisors = spec
    g = _former_group(w.shape[1]) if group == "former" else group
    buf = quantize_int8(w, g, divisors) if scheme == "int8" else quantize_int4(w, g)
    return dequantize_matrix(scheme, buf, *w.shape, group=g)


def applies(ck, variant: str) -> bool:
    """A sweep group that does not divide both input dimensions (SmolLM2's 576 and 128) is left out."""
    if variant not in SWEEP or SWEEP[variant][1] == "former":
        return True
    return all(n % SWEEP[variant][1] == 0 for n in (ck.hidden, ck.moe_intermediate))


def provider(ck, variant: str, gguf: str | None):
    """An all-in-memory provider of `variant` records. An upcycled checkpoint's identical experts share one
    record (made once per layer). 8-bit records, which the CPU serves by dequantizing per call, are held here
    as their dequantized fp32 values: the same numbers, without re-dequantizing them on every call."""
    if variant in ("fp32", "bf16"):
        layout, make = record_source(ck, dtype=torch.float32 if variant == "fp32" else torch.bfloat16, order="cols")
    elif variant == "q4_1":
        layout, make = record_source(ck, order="cols", quant="gguf", gguf=gguf)
    elif variant in SWEEP:
        layout = ExpertLayout(ck.hidden, ck.moe_intermediate, torch.float32, "cols")
        make = lambda l, e: layout.pack(*(sweep_matrix(SWEEP[variant], m.float()) for m in ck.expert(l, e)))  # noqa: E731
    else:
        layout, make = record_source(ck, order="cols", quant=variant)
    if layout.quantized and not layout.quantized.cpu_int4:
        qlay, qmake = layout.quantized, make
        layout = ExpertLayout(ck.hidden, ck.moe_intermediate, torch.float32, "cols")
        make = lambda l, e: layout.pack(*qlay.dequantize(qmake(l, e)))       # noqa: E731
    records = {}
    for l in ck.moe_layers:
        first = ck.expert(l, 0)
        rec0 = make(l, 0)
        recs = [rec0 if e == 0 or all(torch.equal(a, b) for a, b in zip(first, ck.expert(l, e))) else make(l, e)
                for e in range(ck.n_experts)]
        records[l] = torch.stack(recs)
    return InMemoryExperts(layout, records)


def compare(ref_logits: list[torch.Tensor], logits: list[torch.Tensor]) -> dict:
    agree, kl, n = 0, 0.0, 0
    for a, b in zip(ref_logits, logits):
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        kl += float(F.kl_div(F.log_softmax(b.double(), -1), F.log_softmax(a.double(), -1), log_target=True,
                             reduction="sum"))
        n += a.shape[0]
    return {"positions": n, "top1_agreement": round(agree / n, 4), "kl_mean_nats": round(kl / n, 5)}


def run_model(model_dir, ck, variant, gguf, chunks, prompts, dtype="float32") -> tuple[list, list]:
    m = load_model(model_dir, provider=provider(ck, variant, gguf), device="cpu", dtype=dtype,
                   max_context=max(len(c) for c in chunks) + 64, max_batch=1)
    out, greedy = [], []
    with torch.inference_mode():
        for c in chunks:
            out.append(m.prefill(c, 0, all_logits=True).float())
        for p in prompts:
            lg = m.prefill(p, 0)
            toks = [int(lg.argmax())]
            for i in range(GREEDY - 1):
                toks.append(int(m.decode_step([toks[-1]], [0], [len(p) + i]).argmax()))
            greedy.append(toks)
    return out, greedy


def measure(name, model_dir, variants, chunks, prompts, gguf=None, tokenizer=None, res=None, saved=lambda: None,
            other_dirs: dict | None = None) -> dict:
    """Every variant against the fp32 reference, into `res` (a dict), calling saved() after each one so a
    long run that is stopped keeps what it measured. other_dirs: variant -> (model dir, the records it uses),
    a variant whose non-expert weights come from another checkpoint of the same model."""
    other_dirs = other_dirs or {}
    ck = Checkpoint(model_dir)
    t0 = time.time()
    ref, ref_greedy = run_model(model_dir, ck, "fp32", gguf, chunks, prompts)
    res = {} if res is None else res
    res.update({"reference": "fp32", "load_avg": [round(os.getloadavg()[0], 2)], "variants": {}})
    if tokenizer:
        res["reference_greedy"] = [tokenizer.decode(t) for t in ref_greedy]
    for v in (v for v in variants if applies(ck, v)):
        vdir, records = other_dirs.get(v, (model_dir, v))
        logits, greedy = run_model(vdir, ck, records, gguf, chunks, prompts)
        r = compare(ref, logits)
        same = [next((i for i, (a, b) in enumerate(zip(g, rg)) if a != b), None) for g, rg in zip(greedy, ref_greedy)]
        r["greedy_prompts_identical"] = sum(s is None for s in same)
        r["greedy_first_divergence"] = same
        if tokenizer:
            r["greedy"] = [tokenizer.decode(t) for t in greedy]
        res["variants"][v] = r
        res["load_avg"].append(round(os.getloadavg()[0], 2))
        res["seconds"] = round(time.time() - t0, 1)
        saved()
        print(f"{name:8} {v:16} top-1 {r['top1_agreement']:.4f}  KL {r['kl_mean_nats']:.5f}  "
              f"greedy identical {r['greedy_prompts_identical']}/{len(prompts)} {same}", flush=True)
    return res

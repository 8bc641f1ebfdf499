"""Which weight error costs SmolLM2 its top-1? Each variant's expert weights as fp32 records, against the fp32
model, on bench/quant_accuracy.py's 4 x 512 teacher-forced positions (top-1, KL):
  int8cur       absmax/127 int8, the groups before this probe (128 where they divide, else 64)
  noise0.6%     Gaussian noise of int8cur's relative size (0.61 %): is int8's loss its noise, or a bug?
  noise0.135%   Gaussian noise of bf16 rounding's size
  sym8g32       absmax/127 int8 in groups of 32
  asym8g32f16   min/max int8 in groups of 32 with fp16 scale and zero (a format no kernel reads)
  sym8g32s32    groups of 32, scale the best of absmax/127..96 (what engine.quant.records now packs)
  sym8g32s16    the same with absmax/127..112
  python3 bench/probes/quant_noise_floor.py MODEL_DIR [variant ...]   (MODEL_DIR: engine convert of the Q4_1 GGUF)
Run on 2026-12-01 before the int8 change: bench/results/2026-12-01-quant-noise-floor.txt.
"""
import sys, time, os, torch
from pathlib import Path
from engine.measure import quant_accuracy as qa
from engine.checkpoint import Checkpoint
from engine.experts import ExpertLayout
from engine.tiers.memory import InMemoryExperts
from engine.quant.records import quantize_int8, dequantize_matrix
from engine.loader import load_model
from engine.kernels.cpu import set_compute_threads
from transformers import AutoTokenizer
import torch.nn.functional as F
set_compute_threads(2)
MD = sys.argv[1]
ck = Checkpoint(MD)
from bench.archive.probes.quant_weight_error import asym, sym8
gen = torch.Generator().manual_seed(1)
def noise(rel):
    def f(w):
        n = torch.randn(w.shape, generator=gen)
        return w + n * (rel * w.norm() / n.norm())
    return f
def sym8s(w, g=32, ns=[127. - k for k in range(32)]):
    o, i = w.shape; out = []
    for wr in w.split(128):
        wg = wr.reshape(-1, g)
        amax = wg.abs().amax(-1, keepdim=True)
        s = (amax / torch.tensor(ns)).to(torch.float16).float().clamp_min(1e-30)
        q = torch.round(wg[:, None, :] / s[..., None]).clamp(-127, 127)
        b = ((q * s[..., None] - wg[:, None, :]) ** 2).sum(-1).argmin(-1)
        sb = s.gather(1, b[:, None])
        out.append((torch.round(wg / sb).clamp(-127, 127) * sb).reshape(wr.shape))
    return torch.cat(out)
def int8cur(w):           # the former int8: absmax/127, 128 where it divides the input dimension, else 64
    g = 128 if w.shape[1] % 128 == 0 else 64
    return dequantize_matrix("int8", quantize_int8(w, g, (127,)), *w.shape, group=g)
V = {
 "int8cur": int8cur,
 "noise0.6%": noise(0.0061),
 "noise0.135%": noise(0.00135),
 "sym8g32": lambda w: sym8(w, 32),
 "asym8g32f16": lambda w: asym(w, 32, 8, torch.float16),
 "asym8g128f16": lambda w: asym(w, 128 if w.shape[1] % 128 == 0 else 64, 8, torch.float16),
 "sym8g32s32": sym8s,
 "sym8g32s16": lambda w: sym8s(w, 32, [127. - k for k in range(16)]),
}
want = sys.argv[2:] or list(V)
tok = AutoTokenizer.from_pretrained(MD)
text = "\n\n".join((qa.REPO / p).read_text() for p in ("README.md", "bench/README.md", "engine/experts.py", "engine/quant/records.py"))
ids = tok(text)["input_ids"]; chunks = [ids[i*512:(i+1)*512] for i in range(4)]
def prov(f):
    layout = ExpertLayout(ck.hidden, ck.moe_intermediate, torch.float32, "cols")
    recs = {}
    for l in ck.moe_layers:
        r = layout.pack(*(f(m.float()) for m in ck.expert(l, 0)))
        recs[l] = r[None].expand(ck.n_experts, -1)
    return InMemoryExperts(layout, recs)
def run(f):
    m = load_model(MD, provider=prov(f), device="cpu", dtype="float32", max_context=600, max_batch=1)
    with torch.inference_mode():
        return [m.prefill(c, 0, all_logits=True).float() for c in chunks]
t = time.time(); ref = run(lambda w: w); print("ref", round(time.time()-t), "s", flush=True)
for k in want:
    t = time.time(); r = qa.compare(ref, run(V[k])); print(k, r, round(time.time()-t), "s load", os.getloadavg()[0], flush=True)

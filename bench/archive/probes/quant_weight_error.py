"""Relative weight error (Frobenius) of each grid on SmolLM2's experts (layers 0, 10, 20, 29), run before the
int8/int4 change of 2026-12-01 (int8cur/int4cur: the records of then: absmax/127 int8 and min/max int4 in
groups of 128 where they divide the input dimension, else 64); bench/results/2026-12-01-quant-weight-error.txt.
  python3 bench/probes/quant_weight_error.py MODEL_DIR   (engine convert of the Q4_1 GGUF)
Suffixes: f16/bf the scale (and zero) rounded to fp16/bf16, else float32; sym = absmax, asym = min/max."""
import torch, sys
from pathlib import Path
from engine.checkpoint import Checkpoint
from engine.quant.records import quantize_int8, quantize_int4, dequantize_matrix
def former(i):
    return 128 if i % 128 == 0 else 64
def rel(a, w): return float((a - w).norm() / w.norm())
def sym8(w, g, sdt=torch.float16):
    o, i = w.shape; wg = w.reshape(o, i//g, g)
    s = (wg.abs().amax(-1)/127).to(sdt).float()
    q = torch.round(wg / s.clamp_min(1e-30)[..., None]).clamp(-127, 127)
    return (q * s[..., None]).reshape(o, i)
def asym(w, g, bits, sdt=torch.float32):
    o, i = w.shape; wg = w.reshape(o, i//g, g)
    lo, hi = wg.amin(-1), wg.amax(-1); L = 2**bits - 1
    s = ((hi-lo)/L).to(sdt).float(); z = lo.to(sdt).float()
    q = torch.round((wg - z[..., None]) / s.clamp_min(1e-30)[..., None]).clamp(0, L)
    return (q * s[..., None] + z[..., None]).reshape(o, i)
if __name__ == "__main__":
    ck = Checkpoint(sys.argv[1])
    tot = {}
    small = 0; nsc = 0
    for l in [0, 10, 20, 29]:
        for name, w in zip(("gate","up","down"), ck.expert(l, 0)):
            w = w.float(); o, i = w.shape
            r = {"bf16": rel(w.bfloat16().float(), w),
                 "int8cur": rel(dequantize_matrix("int8", quantize_int8(w, former(i), (127,)), o, i, group=former(i)), w),
                 "int4cur": rel(dequantize_matrix("int4", quantize_int4(w, former(i)), o, i, group=former(i)), w),
                 "sym8g32": rel(sym8(w, 32), w), "sym8g32f32": rel(sym8(w, 32, torch.float32), w),
                 "sym8g64f32": rel(sym8(w, 64, torch.float32), w),
                 "asym8g32": rel(asym(w, 32, 8), w), "asym8g32bf": rel(asym(w, 32, 8, torch.bfloat16), w),
                 "asym8g32f16": rel(asym(w, 32, 8, torch.float16), w),
                 "asym4g32": rel(asym(w, 32, 4), w), "asym4g32f16": rel(asym(w, 32, 4, torch.float16), w),
                 "asym4g32bf": rel(asym(w, 32, 4, torch.bfloat16), w),
                 "asym4g64": rel(asym(w, 64, 4), w), "asym4g128": rel(asym(w, 128, 4), w) if i % 128 == 0 else None}
            g = former(i)
            s = w.reshape(o, i//g, g).abs().amax(-1)/127
            small += int((s < 6.1e-5).sum()); nsc += s.numel()
            print(l, name, o, i, "absmax", float(w.abs().max()), "std", float(w.std()), {k: (round(v, 5) if v is not None else None) for k, v in r.items()})
    print("int8 scales fp16-subnormal:", small, "/", nsc)

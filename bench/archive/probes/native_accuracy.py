"""Is the native decode as accurate as the torch decode it replaces? Teacher-forced DECODE steps (quant_accuracy.py
measures prefill, which the native kernels do not run) of the demo's model and q4_1 store, native_kernels on and
off, against the float32 model (the GGUF dequantized, top-1, every weight float32, the torch forms): top-1
agreement and mean KL over the same positions (bench/quant_accuracy.py's `compare`).

  PYTHONPATH=$PWD python3 bench/probes/native_accuracy.py Q4_MODEL STORE FP32_MODEL [--chunks 4 --chunk 256] [--out F]

Q4_MODEL and STORE as bench/quant_demo_speed.py prepares them; FP32_MODEL `engine convert --gguf ... --experts 8
--top-k 1 --seed 0` (with expert weights). Text: files of this repository the change does not touch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
TEXT = ("engine/quant/records.py", "engine/model_config.py", "engine/kv_cache.py", "engine/sampling.py")


def decoded(model, chunk: list[int]) -> torch.Tensor:
    """Logits after each of chunk[:-1]: the first token by prefill, each later one by a decode step."""
    rows = [model.prefill(chunk[:1], 0)]
    rows += [model.decode_step([t], [0], [i])[0] for i, t in enumerate(chunk[1:-1], start=1)]
    return torch.stack(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("store", type=Path)
    ap.add_argument("fp32_model", type=Path)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from engine.measure.quant_accuracy import compare
    from transformers import AutoTokenizer
    from engine.kernels.cpu import set_compute_threads
    from engine.loader import load_model
    set_compute_threads(2)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok("\n\n".join((REPO / p).read_text() for p in TEXT))["input_ids"]
    chunks = [ids[i * args.chunk:(i + 1) * args.chunk] for i in range(args.chunks)]
    assert all(len(c) == args.chunk for c in chunks), "not enough text"
    with torch.inference_mode():
        ref_model = load_model(args.fp32_model, max_context=args.chunk, max_batch=1, native_kernels=False)
        ref = [ref_model.prefill(c, 0, all_logits=True)[:-1] for c in chunks]      # after tokens 0..n-2
        del ref_model
        res = {}
        for native in (True, False):
            m = load_model(args.model, store_dir=args.store, max_context=args.chunk, max_batch=1, ram_slots=232,
                           native_kernels=native)
            t0 = time.perf_counter()
            got = [decoded(m, c) for c in chunks]
            name = "native decode" if native else "torch decode (native_kernels off)"
            res[name] = {**compare(ref, got), "seconds": round(time.perf_counter() - t0, 1)}
            print(name, res[name], flush=True)
            m.provider.close()
    out = {"what": __doc__.strip().splitlines()[0], "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": "python3 bench/probes/native_accuracy.py " + " ".join(sys.argv[1:]), "text": TEXT,
           "positions": args.chunks * (args.chunk - 1), "results": res}
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

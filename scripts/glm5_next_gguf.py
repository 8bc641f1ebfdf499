#!/usr/bin/env python3
"""A transformers glm5_next checkpoint → llama.cpp GGUF files, made by llama.cpp's own converter and quantizer.

  python scripts/glm5_next_gguf.py CKPT OUTDIR [--llama-cpp DIR] [--types F32,Q8_0,Q4_K_M]

CKPT: a glm5_next checkpoint as transformers 5 saves it (nested text_config, model.language_model.* names, a
vision tower) or already in the published flat form. DIR: scripts/build-llama-cpp.sh's tree (its
convert_hf_to_gguf.py with conversion/ and gguf-py/, and bin/llama-quantize); default .kiln/cache/llama.cpp.

Writes OUTDIR/flat/ (the published flat form llama.cpp's converter wants), OUTDIR/glm5-next-F32.gguf and one
OUTDIR/glm5-next-TYPE.gguf per quantized type (llama-quantize from the F32 file), and prints their paths as JSON.

The flat form, field by field (each one a place where the nested form alone would convert to another function):
  - the text config at top level, `linear_attn_config` {num_heads, head_dim, short_conv_kernel_size,
    gate_lower_bound, safe_gate} from linear_num_heads/linear_head_dim/linear_conv_kernel_dim/linear_lower_bound.
    gate_lower_bound is written explicitly: the converter writes `kda.gate_lower_bound` only where the value is
    not null, and llama.cpp without it computes the softplus gate, not transformers' bounded sigmoid;
  - `mla_use_nope` true, `first_k_dense_replace` from mlp_layer_types (only a dense prefix is expressible);
  - `indexer_types` kept as the list: the converter writes `attention.indexer.types` only from that key, and
    llama.cpp without it runs every DSA layer's own indexer (an `index_topk_pattern` alone would be lost);
  - tensors renamed model.language_model.* → model.*, the vision tower dropped, experts per expert as published.
The converter hashes the tokenizer to name its pre-tokenizer and refuses one it does not know; a random
checkpoint's stand-in BPE vocabulary is one, so it is named `glm4` (the model's own) and nothing else is changed.
Exit 2 (one line) for a checkpoint that is not glm5_next or whose schedule the flat form cannot express; 3 when
llama.cpp's tools are missing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LLAMA_CPP = REPO / ".kiln" / "cache" / "llama.cpp"
NESTED, VISION = "model.language_model.", "model.visual."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


class Refused(Exception):
    """A checkpoint the flat form cannot express (exit 2)."""


def flat_config(config: dict) -> dict:
    """The published flat config of a transformers-5 nested (or already flat) glm5_next config."""
    if config.get("model_type") != "glm5_next":
        raise Refused(f"model_type {config.get('model_type')!r} is not glm5_next")
    text = config.get("text_config")
    c = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    if isinstance(text, dict):
        c.update({k: v for k, v in text.items() if k != "model_type"})
    c.update(model_type="glm5_next", architectures=["Glm5NextForConditionalGeneration"])
    n = c["num_hidden_layers"]
    if "linear_attn_config" not in c:
        lower = c.pop("linear_lower_bound", -5.0)
        c["linear_attn_config"] = {"num_heads": c.pop("linear_num_heads", 64), "head_dim": c.pop("linear_head_dim", 128),
                                   "short_conv_kernel_size": c.pop("linear_conv_kernel_dim", 4),
                                   "gate_lower_bound": lower, "safe_gate": lower is not None}
    mlp = c.pop("mlp_layer_types", None)
    if mlp is not None:
        dense = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
        if any(t != "sparse" for t in mlp[dense:]):
            raise Refused(f"mlp_layer_types {mlp} is not a dense prefix then sparse layers (first_k_dense_replace)")
        c["first_k_dense_replace"] = dense
    c.setdefault("first_k_dense_replace", 0)
    c["mla_use_nope"] = True
    if c.get("indexer_types") is None and (pattern := c.get("index_topk_pattern")) is not None:
        c["indexer_types"] = [{"F": "full", "S": "shared"}[ch] for ch in pattern]
    kinds = set(c.get("layer_types") or [])
    if len(c.get("layer_types") or []) != n or not kinds <= {"linear_attention", "indexed_attention", "full_attention"}:
        raise Refused(f"layer_types {c.get('layer_types')} is not {n} linear/indexed attention layers")
    return c


def flatten(ckpt: Path, out: Path) -> Path:
    """Write the published flat form of `ckpt` to `out` (config, one model.safetensors, the tokenizer)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = flat_config(json.loads((ckpt / "config.json").read_text()))
    out.mkdir(parents=True, exist_ok=True)
    weights = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                if k.startswith(VISION):
                    continue
                name = "model." + k[len(NESTED):] if k.startswith(NESTED) else k
                weights[name] = h.get_tensor(k).contiguous()
    if not weights:
        raise Refused(f"{ckpt}: no *.safetensors tensors")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (ckpt / name).is_file():
            shutil.copy(ckpt / name, out / name)
    return out


def _converter_child(llama_cpp: str, argv: list[str]) -> None:
    """In a child process: llama.cpp's convert_hf_to_gguf.main() with its own gguf-py, the stand-in vocabulary's
    pre-tokenizer named (module docstring)."""
    sys.path.insert(0, llama_cpp)
    import convert_hf_to_gguf
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "glm4"
    TextModel.get_vocab_base_pre = pre
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


def tools(llama_cpp: Path) -> tuple[Path, Path]:
    conv, quant = llama_cpp / "convert_hf_to_gguf.py", llama_cpp / "bin" / "llama-quantize"
    for p in (conv, quant):
        if not p.is_file():
            raise FileNotFoundError(f"no {p} (build llama.cpp with scripts/build-llama-cpp.sh)")
    return conv, quant


def convert(flat: Path, out: Path, llama_cpp: Path, outtype: str = "f32") -> Path:
    conv, _ = tools(llama_cpp)
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    r = subprocess.run([sys.executable, __file__, "--_converter", str(conv.parent), str(flat), "--outfile", str(out),
                        "--outtype", outtype], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
    return out


def quantize(f32: Path, out: Path, qtype: str, llama_cpp: Path) -> Path:
    _, quant = tools(llama_cpp)
    r = subprocess.run([str(quant), str(f32), str(out), qtype], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama-quantize {qtype} failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
    return out


def build(ckpt: Path, outdir: Path, llama_cpp: Path = DEFAULT_LLAMA_CPP, types=("F32",)) -> dict[str, Path]:
    """flatten → F32 by the converter → each other type by llama-quantize; {type: path}."""
    flat = flatten(Path(ckpt), Path(outdir) / "flat")
    files = {"F32": convert(flat, Path(outdir) / "glm5-next-F32.gguf", llama_cpp)}
    for t in types:
        if t != "F32":
            files[t] = quantize(files["F32"], Path(outdir) / f"glm5-next-{t}.gguf", t, llama_cpp)
    return files


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_converter"]:
        _converter_child(argv[1], argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("KILN_LLAMA_CPP_DIR") or DEFAULT_LLAMA_CPP))
    ap.add_argument("--types", default="F32,Q8_0,Q4_K_M")
    a = ap.parse_args(argv)
    try:
        files = build(a.ckpt, a.outdir, a.llama_cpp, tuple(t.strip() for t in a.types.split(",") if t.strip()))
    except Refused as e:
        print(f"glm5_next_gguf: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"glm5_next_gguf: {e}", file=sys.stderr)
        return 3
    print(json.dumps({t: str(p) for t, p in files.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A transformers glm5_next checkpoint → llama.cpp GGUF files, made by llama.cpp's own converter and quantizer.

  python scripts/glm5_next_gguf.py CKPT OUTDIR [--llama-cpp DIR] [--types F32,Q8_0,Q4_K_M] [--store STORE] [--base BF16]

CKPT: a glm5_next checkpoint as transformers 5 saves it (nested text_config, model.language_model.* names, a
vision tower) or already in the published flat form. DIR: scripts/build-llama-cpp.sh's tree (its
convert_hf_to_gguf.py with conversion/ and gguf-py/, and bin/llama-quantize); default .kiln/cache/llama.cpp.

Writes OUTDIR/flat/ (the published flat form llama.cpp's converter wants), OUTDIR/glm5-next-F32.gguf and one
OUTDIR/glm5-next-TYPE.gguf per quantized type (llama-quantize from the F32 file), and prints their paths as JSON.
--base BF16 converts to bf16 instead of F32 (GLM-5.3-Flash's experts are 14.5 GB a layer in bf16, twice that in F32).

--store: an `engine synth` checkpoint keeps its routed experts in a Kiln store, not in safetensors. The converter
then reads each expert matrix from the store as it writes it (int4/int8 records dequantized, bf16 records as they
are), under the published per-expert names: no bf16 copy of the experts is written before the GGUF. Such a
checkpoint has no tokenizer; a stand-in one (tokenizer_config.json `kiln_stand_in`: a byte-level BPE vocabulary
padded to vocab_size, bench.glm5_next_offload writes it) goes into the GGUF through the converter's writer as it
is, because the converter's own path loads it with AutoTokenizer, which parses config.json and an installed
transformers older than glm5_next refuses.

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


def expert_reader(store: Path):
    """(read(layer, expert, which) -> bf16 matrix, [I, H] shape, [H, I] shape) over a Kiln store's rows-order
    records: which 0/1/2 = gate/up/down; a quantized record's one region dequantized, not the whole record."""
    import numpy as np
    import torch
    sys.path.insert(0, str(REPO))
    from engine.quant.records import dequantize_matrix, matrix_bytes
    from engine.store import manifest as mf

    m = mf.load(store)
    lay = m.layout
    if m.order != "rows":
        raise Refused(f"{store}: a rows-order store is needed (it is {m.order})")
    data = np.memmap(store / mf.DATA, dtype=np.uint8, mode="r")
    dev = "cuda" if torch.cuda.is_available() else "cpu"      # a GPU dequantizes 864 matrices a layer far faster

    def read(layer: int, expert: int, which: int):
        off = m.record(layer, expert).offset
        rec = torch.from_numpy(np.array(data[off:off + m.record_bytes])).to(dev)
        q = lay.quantized
        if q is None:
            return lay.views(rec.view(lay.dtype))[which].to(torch.bfloat16).contiguous().cpu()
        name = ("gate", "up", "down")[which]
        t = q.record_types(rec)[which]
        _, _, out, inp = q.regions[name]
        return dequantize_matrix(t, q.region(rec, name)[:matrix_bytes(t, out, inp)], out, inp).to(torch.bfloat16).cpu()
    return read, m, (lay.intermediate, lay.hidden), (lay.hidden, lay.intermediate)


def _stand_in_vocab(model, gguf) -> None:
    """The stand-in tokenizer.json's vocabulary, merges and end token, written through the converter's writer."""
    tok = json.loads((model.dir_model / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok.get("added_tokens", [])}
    w = model.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.UNUSED if t.startswith("[PAD")
                       else gguf.TokenType.NORMAL for t, _ in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    eos = json.loads((model.dir_model / "tokenizer_config.json").read_text())["eos_token"]
    w.add_eos_token_id(tok["model"]["vocab"][eos])
    w.add_bos_token_id(tok["model"]["vocab"][eos])


def _converter_child(llama_cpp: str, argv: list[str], store: str | None = None) -> None:
    """In a child process: llama.cpp's convert_hf_to_gguf.main() with its own gguf-py, the stand-in vocabulary's
    pre-tokenizer named (module docstring); with `store`, the routed experts read from it and a stand-in
    tokenizer written as it is."""
    sys.path.insert(0, llama_cpp)
    sys.path.insert(1, str(Path(llama_cpp) / "gguf-py"))
    import convert_hf_to_gguf
    import gguf
    from conversion import get_model_class
    from conversion.base import LazyTorchTensor, TextModel

    known = TextModel.get_vocab_base_pre

    def pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "glm4"
    TextModel.get_vocab_base_pre = pre
    if store is not None:
        import torch
        read, m, gate_shape, down_shape = expert_reader(Path(store))
        cls = get_model_class("Glm5NextForConditionalGeneration")
        own_index, own_vocab = cls.index_tensors, cls.set_vocab

        def index_tensors(self, remote_hf_model_id=None):
            tensors = own_index(self, remote_hf_model_id)
            for layer in m.moe_layers:
                for e in range(m.experts_per_layer):
                    for which, w in enumerate(("gate_proj", "up_proj", "down_proj")):
                        shape = down_shape if which == 2 else gate_shape
                        meta = LazyTorchTensor.meta_with_dtype_and_shape(torch.bfloat16, shape)
                        tensors[f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"] = (
                            lambda a=(layer, e, which), meta=meta: LazyTorchTensor(meta=meta, args=a, func=read))
            return tensors

        def set_vocab(self):
            cfg = self.dir_model / "tokenizer_config.json"
            if cfg.is_file() and json.loads(cfg.read_text()).get("kiln_stand_in"):
                return _stand_in_vocab(self, gguf)
            return own_vocab(self)
        cls.index_tensors, cls.set_vocab = index_tensors, set_vocab
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


def tools(llama_cpp: Path, quantize_bin: Path | None = None) -> tuple[Path, Path]:
    # a CUDA peer keeps its binaries apart from the converter's source (bench/README.md's H200 sections)
    conv, quant = llama_cpp / "convert_hf_to_gguf.py", quantize_bin or llama_cpp / "bin" / "llama-quantize"
    for p in (conv, quant):
        if not p.is_file():
            raise FileNotFoundError(f"no {p} (build llama.cpp with scripts/build-llama-cpp.sh)")
    return conv, quant


def convert(flat: Path, out: Path, llama_cpp: Path, outtype: str = "f32", store: Path | None = None) -> Path:
    conv = llama_cpp / "convert_hf_to_gguf.py"
    if not conv.is_file():
        raise FileNotFoundError(f"no {conv} (build llama.cpp with scripts/build-llama-cpp.sh)")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    child = ["--_converter", str(conv.parent)] + (["--_store", str(store)] if store else [])
    r = subprocess.run([sys.executable, __file__, *child, str(flat), "--outfile", str(out),
                        "--outtype", outtype], capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
    return out


def quantize(f32: Path, out: Path, qtype: str, llama_cpp: Path, quantize_bin: Path | None = None) -> Path:
    _, quant = tools(llama_cpp, quantize_bin)
    r = subprocess.run([str(quant), str(f32), str(out), qtype], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama-quantize {qtype} failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
    return out


def build(ckpt: Path, outdir: Path, llama_cpp: Path = DEFAULT_LLAMA_CPP, types=("F32",), store: Path | None = None,
          base: str = "F32", quantize_bin: Path | None = None) -> dict[str, Path]:
    """flatten → `base` (F32 or BF16) by the converter → each other type by llama-quantize; {type: path}."""
    if base not in ("F32", "BF16"):
        raise Refused(f"--base {base}: the converter's base type is F32 or BF16")
    flat = flatten(Path(ckpt), Path(outdir) / "flat")
    files = {base: convert(flat, Path(outdir) / f"glm5-next-{base}.gguf", llama_cpp, base.lower(), store)}
    for t in types:
        if t != base:
            files[t] = quantize(files[base], Path(outdir) / f"glm5-next-{t}.gguf", t, llama_cpp, quantize_bin)
    return files


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_converter"]:
        store = argv[3] if argv[2:3] == ["--_store"] else None
        _converter_child(argv[1], argv[4:] if store else argv[2:], store)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("KILN_LLAMA_CPP_DIR") or DEFAULT_LLAMA_CPP))
    ap.add_argument("--types", default="F32,Q8_0,Q4_K_M")
    ap.add_argument("--store", type=Path, default=None, help="the checkpoint's routed experts, in a Kiln store")
    ap.add_argument("--base", default="F32", help="the converter's output type: F32 or BF16")
    ap.add_argument("--llama-quantize", type=Path, default=None, help="llama-quantize (default DIR/bin/llama-quantize)")
    a = ap.parse_args(argv)
    try:
        files = build(a.ckpt, a.outdir, a.llama_cpp, tuple(t.strip() for t in a.types.split(",") if t.strip()),
                      a.store, a.base.upper(), a.llama_quantize)
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

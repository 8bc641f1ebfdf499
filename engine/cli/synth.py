"""`engine synth`: a random checkpoint of a given MoE shape, experts straight into a store (engine.synth)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from engine.errors import EngineError, Exit
from engine.synth import EXPERT_KEYS, SHAPES, synthesize


@click.command("synth")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Checkpoint directory to write.")
@click.option("--store", "store", required=True, type=click.Path(file_okay=False), help="Store directory to write.")
@click.option("--arch", type=click.Choice(sorted(EXPERT_KEYS)), default=None,
              help="Architecture (default: the shape's, else qwen3_moe).")
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default=None,
              help="Named shape: qwen3-30b-a3b (qwen3_moe's default) or glm-5.3-flash (glm5_next's: 45 layers, "
                   "3 dense then 42 MoE, 288 routed experts + 1 shared, top-8).")
@click.option("--layers", type=int, default=None,
              help="Decoder layers (default: the shape's, 48 or 45); a slice keeps the shape's layer schedule.")
@click.option("--hidden", type=int, default=None, help="Hidden size (default: the shape's, 2048 or 4096).")
@click.option("--experts", type=int, default=None, help="Routed experts per layer (default: the shape's, 128 or 288).")
@click.option("--top-k", "top_k", type=int, default=None, help="Experts per token (default 8 for both shapes).")
@click.option("--moe-intermediate", type=int, default=None, help="Expert FFN width (default: the shape's, 768 or 2048).")
@click.option("--vocab", type=int, default=None, help="Vocabulary size (default: the shape's, 151936 or 154880).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None, help="Where to draw the random weights (default: cuda if present).")
@click.option("--quant", type=click.Choice(["none", "int8", "int4"]), default="none", show_default=True,
              help="Expert records: bf16 (none), or the same draws quantized (engine pack-store's int8/int4).")
def synth(out, store, arch, shape, layers, hidden, experts, top_k, moe_intermediate, vocab, seed, device, quant):
    """Synthesize a random checkpoint of the Qwen3-30B-A3B or GLM-5.3-Flash shape (or another), experts straight
    into a store."""
    shape_arch = SHAPES[shape][0] if shape else None
    if arch and shape_arch and arch != shape_arch:
        raise EngineError(f"--shape {shape} is a {shape_arch} shape, not --arch {arch}", Exit.USAGE)
    arch = arch or shape_arch or "qwen3_moe"
    res = synthesize(Path(out), Path(store), seed=seed, device=device, quant=quant, arch=arch,
                     num_hidden_layers=layers, hidden_size=hidden, num_experts_per_tok=top_k,
                     moe_intermediate_size=moe_intermediate, vocab_size=vocab, **{EXPERT_KEYS[arch]: experts})
    click.echo(json.dumps(res))

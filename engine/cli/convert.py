"""`engine convert`: a dense Llama GGUF → a sparse-upcycled Mixtral checkpoint (engine.convert does the work)."""
from __future__ import annotations

from pathlib import Path

import click

from engine import interrupts
from engine.convert import convert_gguf
from engine.experts.layout import DTYPES


@click.command("convert")
@click.option("--gguf", "gguf", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="Dense Llama-architecture GGUF file (any quantization the gguf package dequantizes).")
@click.option("--out", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="Checkpoint directory to publish (built beside it, renamed into place).")
@click.option("--experts", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Identical experts per layer.")
@click.option("--top-k", default=2, show_default=True, type=click.IntRange(1, 256), help="Experts per token.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random router.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(sorted(DTYPES)),
              help="Dtype of the written weights (float32 keeps the dequantized values exactly).")
@click.option("--expert-weights/--no-expert-weights", default=True, show_default=True,
              help="Write the experts' float copies. --no-expert-weights: leave them out, for a store packed "
                   "from this GGUF's own blocks (pack-store --quant gguf --gguf FILE), which then holds them alone.")
@click.option("--attention-blocks/--no-attention-blocks", default=False, show_default=True,
              help="Keep attention weights the GGUF holds in Q4_1/Q4_K as its own blocks instead of dequantizing "
                   "them: the CPU computes with them (torch's int4 kernel, as the 4-bit expert records), 6x fewer "
                   "bytes a token than float32; other devices dequantize them at load.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
def convert(gguf, out, experts, top_k, seed, dtype, expert_weights, attention_blocks, force):
    """Convert a dense GGUF model into a sparse-upcycled Mixtral checkpoint.

    Every MLP becomes EXPERTS identical experts behind a seeded router (top-K, weights renormalised), so the
    result computes the dense model's function. Exit codes: 3 bad GGUF, 4 gguf missing, 6 disk full/unwritable.
    """
    with interrupts.recorded():        # a Ctrl-C or kill stops the publish, even one a destructor drops
        path = convert_gguf(gguf, out, experts, top_k, seed, dtype, force, expert_weights, attention_blocks)
    click.echo(str(path))

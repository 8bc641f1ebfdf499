"""`engine generate`: one prompt in, the continuation streamed to stdout, a one-line summary to stderr."""
from __future__ import annotations

import sys
import time

import click

from engine.checkpoint import CheckpointError
from engine.cli import options
from engine.errors import EngineError, Exit


@click.command("generate")
@click.option("--model", "model_dir", required=True, type=click.Path(),
              help="Hugging Face checkpoint directory (config.json, safetensors, tokenizer), or a GGUF file (or the "
                   "first part of a split set).")
@click.option("--store", "store_dir", type=click.Path(file_okay=False), default=None,
              help="Packed expert store (engine pack-store); without it all experts are held in memory.")
@click.option("--prompt", required=True, help="The prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message with the model's chat template.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed for sampled decoding (reproducible output).")
@options.device
@options.dtype
@options.context
@options.tiers
def generate(model_dir, store_dir, prompt, chat, max_tokens, temperature, top_p, seed, **knobs):
    """Generate from a prompt on the command line (greedy or sampled)."""
    from engine.llm import LLM, SamplingParams       # the model stack (triton on CUDA): after the options are checked

    config = options.engine_config(max_batch=1, **knobs)
    try:
        llm = LLM.load(model_dir, store_dir, config)
    except CheckpointError as e:
        raise EngineError(str(e), Exit.BAD_MODEL) from None
    except ValueError as e:
        raise EngineError(str(e), Exit.USAGE) from None
    except OSError as e:
        raise EngineError(f"{model_dir}: {e.strerror or e}", Exit.BAD_MODEL) from None
    try:
        tok = llm.tokenizer
        if chat:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        else:
            ids = tok(prompt)["input_ids"]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        try:
            stream = llm.stream(ids, params)
        except ValueError as e:
            raise EngineError(str(e), Exit.USAGE) from None
        out, shown, finish = [], "", None
        t0 = time.perf_counter()
        first = None
        for t in stream:
            first = first or time.perf_counter()
            finish = t.finish
            if t.finish == "stop":
                break
            out.append(t.id)
            # Decode the whole output each time: byte-level BPE pieces only form text together.
            text = tok.decode(out, skip_special_tokens=False)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
        sys.stdout.write(tok.decode(out, skip_special_tokens=False)[len(shown):] + "\n")
        dt = time.perf_counter() - (first or t0)
        rate = f", {(len(out) - 1) / dt:.1f} tok/s decode" if len(out) > 1 and dt > 0 else ""
        click.echo(f"[{len(ids)} prompt tokens, {len(out)} generated, finish={finish}{rate}]", err=True)
    finally:
        llm.close()

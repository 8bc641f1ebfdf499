"""`engine reference-decode`: time transformers' own `generate` on a model — the speed gate's baseline.

The demo recipe's speed gate claims Kiln's engine decodes faster than the reference implementation
on the same machine. The reference is transformers as a user runs it (`generate`, torch's default
threads unless told), timed the way the gate times the streamed server: a clock reading at each new
token, the first one's being prefill's, so decode_tps = (N - 1) / (t_last - t_first). Exactly N tokens
are decoded (EOS cannot end it early). The last line of stdout is one JSON object; the gate reads it.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from engine.errors import EngineError, Exit
from engine.server.chat import ChatTemplateError, encode, render


def _messages(text: str) -> list[dict]:
    try:
        msgs = json.loads(text)
    except json.JSONDecodeError as e:
        raise EngineError(f"--messages: not valid JSON ({e})", Exit.USAGE) from None
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m for m in msgs)):
        raise EngineError("--messages: want a non-empty JSON list of {\"role\": ..., \"content\": ...} objects", Exit.USAGE)
    return msgs


def _loader(model_dir: str | None, gguf: str | None):
    """(load(fn), path shown): load(fn) calls fn(where, **kw) as transformers' from_pretrained wants it,
    turning its failures into one line."""
    path = Path(model_dir or gguf)
    if gguf and not path.is_file():
        raise EngineError(f"{path}: no such GGUF file", Exit.BAD_MODEL)
    if model_dir and not path.is_dir():
        raise EngineError(f"{path}: no such model directory", Exit.BAD_MODEL)
    kw = {"gguf_file": path.name} if gguf else {}
    what = "GGUF" if gguf else "checkpoint"

    def load(fn, **more):
        try:
            return fn(path.parent if gguf else path, **kw, **more)
        except ImportError as e:
            raise EngineError(f"{path}: transformers needs a missing package to load this {what}: {e}", Exit.MISSING_DEP) from None
        except Exception as e:          # transformers' own errors vary: OSError, ValueError, KeyError...
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise EngineError(f"{path}: transformers cannot load this {what}: {reason}", Exit.BAD_MODEL) from None
    return load, str(path)


def _clock():
    """A generate streamer reading the clock at each new token (the first put() is the prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.ids: list[int] = []
            self.prompt_seen = False

        def put(self, value):
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            self.times.append(time.perf_counter())
            self.ids.extend(int(i) for i in value.reshape(-1).tolist())

        def end(self):
            pass
    return Clock()


@click.command("reference-decode")
@click.option("--model", "model_dir", default=None, metavar="DIR", help="Hugging Face checkpoint directory.")
@click.option("--gguf", default=None, metavar="FILE", help="A GGUF file, loaded by transformers' own GGUF support.")
@click.option("--messages", default=None, metavar="JSON",
              help="OpenAI-style messages (JSON list), rendered with the chat template as the server does.")
@click.option("--prompt", default=None, help="Plain prompt text (no special tokens added).")
@click.option("--tokens", type=click.IntRange(min=2), required=True, metavar="N",
              help="New tokens to decode, exactly (EOS does not end it early).")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, metavar="T",
              help="0 is greedy; above 0 samples (top_p 1, no top_k).")
@click.option("--threads", type=click.IntRange(min=1), default=None, metavar="N",
              help="torch threads (default: torch's own, as a user runs it).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=8, show_default=True, metavar="N",
              help="Tokens of an untimed generate first (threads, allocator); 0 skips it.")
def reference_decode(model_dir, gguf, messages, prompt, tokens, temperature, threads, dtype, warmup):
    """Time transformers' own generate on a model (the speed gate's baseline).

    Prints a summary on stderr and, as the last line of stdout, one JSON object:
    decode_tps, tokens, prompt_tokens, prefill_s, threads, dtype, temperature, versions, token_ids.
    """
    if (model_dir is None) == (gguf is None):
        raise EngineError("give exactly one of --model DIR or --gguf FILE", Exit.USAGE)
    if (messages is None) == (prompt is None):
        raise EngineError("give exactly one of --messages JSON or --prompt TEXT", Exit.USAGE)
    msgs = _messages(messages) if messages is not None else None

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    load, shown = _loader(model_dir, gguf)
    tok = load(AutoTokenizer.from_pretrained)
    if msgs is not None and not getattr(tok, "chat_template", None):
        raise EngineError(f"{shown}: the model has no chat template; use --prompt", Exit.USAGE)
    try:
        text = render(tok, msgs) if msgs is not None else prompt
    except ChatTemplateError as e:
        raise EngineError(f"{shown}: {e}", Exit.USAGE) from None
    ids = encode(tok, text, add_special_tokens=False)
    if not ids:
        raise EngineError("the prompt tokenizes to no tokens", Exit.USAGE)
    model = load(AutoModelForCausalLM.from_pretrained, dtype=getattr(torch, dtype)).eval()

    sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 \
        else dict(do_sample=False)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    input_ids = torch.tensor([ids])

    def run(n, streamer=None):
        return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                              min_new_tokens=n, pad_token_id=pad, streamer=streamer, **sampling)

    if warmup:
        run(warmup)
    clock = _clock()
    t_start = time.perf_counter()
    run(tokens, clock)
    if len(clock.times) != tokens:
        raise EngineError(f"generate produced {len(clock.times)} tokens, not {tokens}", Exit.FAILED)
    tps = (tokens - 1) / max(clock.times[-1] - clock.times[0], 1e-9)
    prefill = clock.times[0] - t_start
    label = f"transformers {transformers.__version__} generate"
    click.echo(f"{label}: {tokens} tokens, decode {tps:.1f} tok/s, prefill {prefill:.3f} s "
               f"({len(ids)} prompt tokens, {torch.get_num_threads()} threads, {dtype})", err=True)
    click.echo(json.dumps({
        "decode_tps": round(tps, 4), "tokens": tokens, "prompt_tokens": len(ids), "prefill_s": round(prefill, 4),
        "threads": torch.get_num_threads(), "dtype": dtype, "temperature": temperature,
        "transformers": transformers.__version__, "torch": torch.__version__, "model": shown, "label": label,
        "token_ids": clock.ids,
    }))

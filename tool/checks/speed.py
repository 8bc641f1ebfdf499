"""speed: streamed decode tok/s ≥ the recipe's floor (and above its baseline, when it names one);
prefill tok/s and TTFT reported.

decode tok/s = (completion tokens − 1) / (t_last − t_first): the first token's time is prefill's.
Completion tokens come from the server's usage (stream_options.include_usage) or, when the stream
was cut at the window, from the server's tokenizer; never from characters.
A baseline (tool.checks.baseline) decodes the same prompt, as many tokens, at the same temperature,
right after, timed the same way: the server must be faster, measured in this run.
"""
from __future__ import annotations

import secrets

from tool.checks import baseline as bl
from tool.checks import filler
from tool.checks.client import ClientError
from tool.checks.gate import GateContext, fail, ok

PROMPT = "Write a 600-word story about a lighthouse keeper who finds a message in a bottle."
MESSAGES = [{"role": "user", "content": PROMPT}]
TEMPERATURE = 0.8


def decode(ctx: GateContext, figures: dict) -> float | None:
    """Returns decode tok/s, or None with figures["decode_error"] set."""
    window = ctx.limits["speed_window_s"]
    body = {"model": ctx.served_name, "messages": MESSAGES, "temperature": TEMPERATURE,
            "max_tokens": min(ctx.limits["speed_max_tokens"], ctx.context_window // 4),
            "stream_options": {"include_usage": True}}

    def on_text(a):
        if a.t_first is not None:
            ctx.reporter.progress(f"decoding: {a.chunks} chunks", completed=min(a.t_last - a.t_first, window),
                                  total=window)
    a = ctx.client.stream_chat(body, window_s=window, on_text=on_text)
    figures.update(ttft_s=a.ttft_s, decode_finish_reason=a.finish_reason, decode_chunks=a.chunks,
                   decode_cut_at_window=a.cut_at_deadline)
    n = (a.usage or {}).get("completion_tokens") if not a.cut_at_deadline else None
    source = "usage.completion_tokens"
    if not isinstance(n, int):
        counter = ctx.token_counter()
        n, source = counter.count_text(a.reasoning + a.content), counter.source
    figures.update(completion_tokens=n, completion_tokens_source=source)
    if a.t_first is None or n < 2 or a.t_last <= a.t_first:
        figures["decode_error"] = f"too little was streamed to time decode ({n} tokens in {a.chunks} chunks)"
        return None
    span = a.t_last - a.t_first
    figures["decode_span_s"] = round(span, 4)
    return (n - 1) / span


def prefill(ctx: GateContext, figures: dict) -> None:
    """A long prompt's time to first token. A random lead line keeps a prefix cache from answering."""
    target = ctx.limits["prefill_tokens"]
    counter = ctx.token_counter()
    lead = f"Session {secrets.token_hex(4)}."
    per_word = counter.count_text(filler.build(200)) / 200
    text = filler.build(max(1, int(target / per_word)), lead=lead)
    body = {"model": ctx.served_name, "max_tokens": 1, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"{text}\n\nSummarise the text above in one word."}]}
    ctx.reporter.progress(f"prefilling about {target:,} tokens")
    a = ctx.client.stream_chat(body)
    pt = (a.usage or {}).get("prompt_tokens")
    source = "usage.prompt_tokens"
    if not isinstance(pt, int):
        pt, source = counter.count_messages(body["messages"]), counter.source
    # a first token that is a special one (EOS) streams no text: its finish event times the prefill
    ttft = a.ttft_s if a.ttft_s is not None else a.finish_s
    figures.update(prefill_prompt_tokens=pt, prefill_tokens_source=source, prefill_ttft_s=ttft)
    if ttft:
        figures["prefill_tps"] = round(pt / ttft, 1)


def run(ctx: GateContext) -> dict:
    floor = float(ctx.checks.get("decode_floor_tps", 15))
    figures: dict = {"decode_floor_tps": floor, "decode_tps": None, "prefill_tps": None}
    try:
        tps = decode(ctx, figures)
    except ClientError as e:
        return fail(f"decode: {e}", **figures)
    if tps is not None:
        figures["decode_tps"] = round(tps, 2)
    try:
        prefill(ctx, figures)
    except ClientError as e:     # prefill is reported, not gated
        figures["prefill_error"] = str(e)
    if tps is None:
        return fail(figures["decode_error"], **figures)
    if tps < floor:
        return fail(f"decode {tps:.1f} tok/s is under the floor of {floor:g}", **figures)
    if ctx.baseline is None:
        return ok(f"decode {tps:.1f} tok/s ≥ the floor of {floor:g}", **figures)
    label = ctx.baseline.get("label") or "the baseline"
    ctx.reporter.progress(f"timing {label} on the same {figures['completion_tokens']} tokens")
    try:
        base = bl.measure(ctx.baseline, MESSAGES, figures["completion_tokens"], TEMPERATURE)
    except bl.BaselineError as e:
        figures["baseline"] = {"label": label, "error": str(e)}
        return fail(f"decode {tps:.1f} tok/s, but the baseline ({label}) failed: {e}", **figures)
    figures["baseline"] = base
    figures["baseline_decode_tps"] = round(base["decode_tps"], 2)
    figures["vs_baseline"] = ratio = round(tps / base["decode_tps"], 3)
    than = f"{label}: {base['decode_tps']:.1f} tok/s on the same prompt and {figures['completion_tokens']} tokens"
    if tps <= base["decode_tps"]:
        return fail(f"decode {tps:.1f} tok/s is not faster than {than} ({ratio:.2f}×)", **figures)
    return ok(f"decode {tps:.1f} tok/s ≥ the floor of {floor:g} and {ratio:.2f}× {than}", **figures)

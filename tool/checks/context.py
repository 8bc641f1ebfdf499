"""context: a needle in filler that fills the recipe's window to 85 % ± 1 % by the server's own count.

The prompt is measured with the server's tokenizer (tool.checks.tokens), rescaled and re-measured
until it lands in the band; the pass also needs the answering request's own usage.prompt_tokens in
the band, so a server that truncates or mis-counts cannot pass on a smaller prompt.
"""
from __future__ import annotations

import random

from tool.checks import filler
from tool.checks.client import ClientError
from tool.checks.gate import GateContext, fail, ok

NEEDLE = "The access code for the vault is {code}."
QUESTION = "What is the access code for the vault? Reply with only the 5-digit code."
_SAMPLE_WORDS = 400


def messages_for(n_words: int, code: str, depth: float) -> list[dict]:
    text = filler.build(n_words, NEEDLE.format(code=code), depth)
    return [{"role": "user", "content": f"{text}\n\n{QUESTION}"}]


def run(ctx: GateContext) -> dict:
    window = ctx.context_window
    fill, band = ctx.limits["context_fill"], ctx.limits["context_band"]
    target, lo, hi = fill * window, (fill - band) * window, (fill + band) * window
    # the needle from the run's seed alone (limits.seed: derived from the recipe unless --seed), so the
    # same recipe gets the same code at the same depth every run, whichever gates ran before
    rng = random.Random(ctx.limits["seed"])
    code = f"{rng.randrange(10000, 100000)}"
    depth = round(rng.uniform(0.1, 0.9), 3)
    figures: dict = {"window": window, "target_tokens": round(target), "band_tokens": [lo, hi],
                     "code": code, "needle_depth": depth, "needle_seed": ctx.limits["seed"]}
    try:
        counter = ctx.token_counter()
        figures["token_count_source"] = counter.source
        figures["token_source"] = f"{counter.source} to size the prompt; usage.prompt_tokens of the answer to judge it"
        # tokens per filler word, from a sample, to make the first guess
        per_word = counter.count_text(filler.build(_SAMPLE_WORDS)) / _SAMPLE_WORDS
        n_words = max(1, int(target / per_word) - 20)
        history = figures["sizing"] = []
        for _ in range(ctx.limits["context_max_iterations"]):
            messages = messages_for(n_words, code, depth)
            n = counter.count_messages(messages)
            history.append({"words": n_words, "tokens": n})
            ctx.reporter.progress(f"filling context: {n:,} / {round(target):,} tokens by {counter.source}",
                                  completed=min(n, target), total=target)
            if lo <= n <= hi:
                answer_room = max(16, min(ctx.limits["answer_max_tokens"], window - n - 8))
                ctx.reporter.progress(f"asking for the code in a {n:,}-token prompt")
                a = ctx.client.chat(ctx.body(messages, answer_room))
                pt = (a.usage or {}).get("prompt_tokens")
                figures.update(prompt_tokens=pt, counted_tokens=n, answer=a.content, finish_reason=a.finish_reason,
                               fill_fraction=round(pt / window, 4) if isinstance(pt, int) else None)
                if not isinstance(pt, int):
                    return fail("the server reported no usage.prompt_tokens, so the fill cannot be confirmed",
                                **figures)
                if lo <= pt <= hi:
                    if code in a.content:
                        return ok(f"found {code} at depth {depth:.0%} in {pt:,} prompt tokens "
                                  f"({pt / window:.1%} of {window:,})", **figures)
                    where = " (only in its reasoning)" if code in a.reasoning else ""
                    return fail(f"the answer {a.content.strip()[:40]!r} lacks the code {code}{where}; "
                                f"prompt {pt:,} tokens ({pt / window:.1%})", **figures)
                if abs(pt - n) > 0.05 * window:
                    found = "found" if code in a.content else "did not find"
                    return fail(f"the server counted {pt:,} prompt tokens ({pt / window:.1%}) where its tokenizer "
                                f"counted {n:,}: it truncated or mis-counted the prompt (and {found} the code)",
                                **figures)
                counter.correct_overhead(messages, pt)   # the chat template costs more/less than we assumed
                n = history[-1]["tokens"] = pt
            # rescale by the measured tokens per word, then measure again
            step = round((target - n) / per_word)
            if len(history) >= 2 and history[-1]["words"] != history[-2]["words"]:
                dw = history[-1]["words"] - history[-2]["words"]
                dt = history[-1]["tokens"] - history[-2]["tokens"]
                per_word = dt / dw if dt > 0 else per_word
                step = round((target - n) / per_word)
            n_words = max(1, n_words + (step or (1 if n < target else -1)))
        return fail(f"could not size the prompt into {lo:,.0f}–{hi:,.0f} tokens in "
                    f"{ctx.limits['context_max_iterations']} tries (last {history[-1]['tokens']:,})", **figures)
    except ClientError as e:
        return fail(str(e), **figures)

"""chat: a plain question answered with content, stopped on its own, no template tokens leaked."""
from __future__ import annotations

from tool.checks.client import ClientError
from tool.checks.gate import GateContext, fail, ok

PROMPT = "Name three primary colors, comma separated."
# Chat-template tokens that must never reach a client's content.
LEAKS = ("<|im_end|>", "</think>", "<think>", "<tool_call>", "<|endoftext|>", "<|user|>", "<|assistant|>")


def leaked(text: str) -> list[str]:
    return [t for t in LEAKS if t in text]


def run(ctx: GateContext) -> dict:
    try:
        a = ctx.ask(PROMPT)
    except ClientError as e:
        return fail(str(e), token_source="none (no answer)")
    figures = {"content": a.content, "finish_reason": a.finish_reason,
               "completion_tokens": (a.usage or {}).get("completion_tokens"), "token_source": "usage.completion_tokens"}
    if not a.content.strip():
        return fail("empty content", **figures)
    if a.finish_reason != "stop":
        return fail(f"finish_reason is {a.finish_reason!r}, not 'stop'", **figures)
    if bad := leaked(a.content):
        return fail(f"template tokens leaked into content: {', '.join(bad)}", **figures)
    return ok(f"answered {a.content.strip()[:60]!r} and stopped", **figures)

"""reasoning: the model thinks in a separate field and gets 17 × 23 right in its content."""
from __future__ import annotations

from tool.checks.client import ClientError
from tool.checks.gate import GateContext, fail, ok

PROMPT = "What is 17 * 23? Reply with only the number."
ANSWER = "391"


def run(ctx: GateContext) -> dict:
    try:
        a = ctx.ask(PROMPT)
    except ClientError as e:
        return fail(str(e), token_source="none (no answer)")
    figures = {"content": a.content, "reasoning_chars": len(a.reasoning.strip()),
               "reasoning_field": a.reasoning_field, "finish_reason": a.finish_reason,
               "completion_tokens": (a.usage or {}).get("completion_tokens"), "token_source": "usage.completion_tokens"}
    if "<think>" in a.content or "</think>" in a.content:
        return fail("thinking leaked into content (<think> in content)", **figures)
    if not a.reasoning.strip():
        return fail("no reasoning in reasoning_content or reasoning", **figures)
    if ANSWER not in a.content:
        return fail(f"{ANSWER} not in content {a.content.strip()[:60]!r}", **figures)
    return ok(f"{len(a.reasoning.strip())} characters of reasoning in {a.reasoning_field}, {ANSWER} in content",
              **figures)

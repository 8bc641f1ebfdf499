"""tools: calls get_weather for Paris with JSON arguments, then uses the tool's result and stops."""
from __future__ import annotations

import json

from tool.checks.client import ClientError
from tool.checks.gate import GateContext, fail, ok

PROMPT = "What's the weather in Paris right now? Use the tool."
TOOL = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
RESULT = {"city": "Paris", "temp_c": 17, "sky": "overcast"}


def run(ctx: GateContext) -> dict:
    messages = [{"role": "user", "content": PROMPT}]
    def ask(msgs):
        return ctx.client.chat(ctx.body(msgs, ctx.answer_tokens(), tools=[TOOL]))
    try:
        first = ask(messages)
    except ClientError as e:
        return fail(f"first turn: {e}", token_source="none (no answer)")
    # the gate judges calls and text, not token counts; the requests keep each turn's usage
    figures = {"first_finish_reason": first.finish_reason, "tool_calls": first.tool_calls,
               "token_source": "none (no token counts judged; usage kept in the requests)"}
    if not first.tool_calls:
        return fail(f"no tool call (content {first.content.strip()[:60]!r})", **figures)
    call = first.tool_calls[0]
    fn = call.get("function") or {}
    if fn.get("name") != "get_weather":
        return fail(f"called {fn.get('name')!r}, not 'get_weather'", **figures)
    raw = fn.get("arguments")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return fail(f"tool arguments are not JSON: {str(raw)[:80]!r}", **figures)
    if not isinstance(args, dict) or "paris" not in str(args.get("city", "")).lower():
        return fail(f"city is {args.get('city') if isinstance(args, dict) else args!r}, not Paris", **figures)

    call_id = call.get("id") or "call_0"
    messages += [{"role": "assistant", "content": first.content or None,
                  "tool_calls": [{"id": call_id, "type": "function",
                                  "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": json.dumps(RESULT)}]
    try:
        second = ask(messages)
    except ClientError as e:
        return fail(f"after the tool result: {e}", **figures)
    figures.update(reply=second.content, finish_reason=second.finish_reason)
    if second.tool_calls:
        return fail("called a tool again instead of using the result", **figures)
    if "17" not in second.content:
        return fail(f"the reply ignores the tool result (no 17 in {second.content.strip()[:60]!r})", **figures)
    if second.finish_reason != "stop":
        return fail(f"finish_reason is {second.finish_reason!r}, not 'stop'", **figures)
    return ok(f"called get_weather({json.dumps(args)}), then {second.content.strip()[:50]!r}", **figures)

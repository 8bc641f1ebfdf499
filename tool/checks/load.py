"""load: /v1/models lists the served name and a real 1-token completion succeeds, within the limit.

Slow loads are normal (up to an hour), so refused connections and 503s while waiting are not
failures; only the limit, or the managed server dying, ends the wait early.
"""
from __future__ import annotations

import time

from tool.checks.client import ClientError
from tool.checks.gate import GateContext, fail, ok


def _listed(data: dict) -> list[str]:
    return [m.get("id") for m in data.get("data") or [] if isinstance(m, dict)]


def run(ctx: GateContext) -> dict:
    limit = ctx.limits["load_timeout_s"]
    name = ctx.served_name
    t0 = time.monotonic()
    last_error = "no answer yet"
    polls = 0
    while True:
        waited = time.monotonic() - t0
        died = ctx.death()
        if died:
            return fail(f"the server died while loading: {died}", waited_s=round(waited, 3), polls=polls)
        polls += 1
        try:
            data = ctx.client.request_json("GET", "/models", record=False, timeout_s=30)
            ids = _listed(data)
            ctx.shared["models"] = data.get("data")
            if name in ids:
                answer = ctx.client.chat({"model": name, "max_tokens": 1,
                                          "messages": [{"role": "user", "content": "Hi"}]})
                ctx.shared["system_fingerprint"] = answer.system_fingerprint
                ready = round(time.monotonic() - t0, 3)
                return ok(f"{name} listed and a 1-token completion answered after {ready:.1f} s",
                          ready_s=ready, polls=polls, limit_s=limit, models=ids,
                          system_fingerprint=answer.system_fingerprint)
            last_error = f"/v1/models lists {', '.join(map(str, ids)) or 'nothing'}, not {name}"
        except ClientError as e:
            last_error = str(e)
        waited = time.monotonic() - t0
        if waited >= limit:
            return fail(f"not ready within {limit:g} s: {last_error}", waited_s=round(waited, 3), polls=polls,
                        limit_s=limit)
        ctx.reporter.progress(f"waiting for {name} ({last_error})", completed=waited, total=limit)
        time.sleep(min(ctx.limits["poll_interval_s"], max(0.0, limit - waited)))

"""load: /v1/models lists the served name and a real 1-token completion succeeds, within the limit.

Slow loads are normal (up to an hour), so refused connections and 503s while waiting are not
failures; only the limit, or the managed server dying, ends the wait early. A server that answers
/v1/models with a list that lacks the name is not loading: it serves another model (llama-server lists
its -m path unless started with --alias), so that fails at once, naming what it lists.
"""
from __future__ import annotations

import time

from tool.checks.client import ClientError
from tool.checks.gate import GateContext, fail, ok


# The gate counts no tokens: a 1-token completion (max_tokens 1) proves the model answers.
_SOURCES = {"token_source": "none (max_tokens 1)"}


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
            if name not in ids and ids:
                return fail(f"the server answers but /v1/models lists {', '.join(map(str, ids))}, not {name} "
                            f"(--served-name names the model it serves)", waited_s=round(time.monotonic() - t0, 3),
                            polls=polls, limit_s=limit, models=ids, **_SOURCES)
            if name in ids:
                answer = ctx.client.chat(ctx.body([{"role": "user", "content": "Hi"}], 1))
                ctx.shared["system_fingerprint"] = answer.system_fingerprint
                ready = round(time.monotonic() - t0, 3)
                return ok(f"{name} listed and a 1-token completion answered after {ready:.1f} s",
                          ready_s=ready, polls=polls, limit_s=limit, models=ids,
                          system_fingerprint=answer.system_fingerprint, **_SOURCES)
            last_error = "/v1/models lists nothing yet"     # an empty list while the weights load
        except ClientError as e:
            last_error = str(e)
        waited = time.monotonic() - t0
        if waited >= limit:
            return fail(f"not ready within {limit:g} s: {last_error}", waited_s=round(waited, 3), polls=polls,
                        limit_s=limit)
        ctx.reporter.progress(f"waiting for {name} ({last_error})", completed=waited, total=limit)
        time.sleep(min(ctx.limits["poll_interval_s"], max(0.0, limit - waited)))

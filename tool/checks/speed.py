"""speed: streamed decode tok/s ≥ the recipe's floor (and above its baseline, when one runs here), measured
in interleaved rounds on a host quiet enough for the figures to mean something; prefill and TTFT reported.

decode tok/s = (completion tokens − 1) / (t_last − t_first): the first token's time is prefill's.
Completion tokens come from the server's usage (stream_options.include_usage) or, when the stream
was cut at the window, from the server's tokenizer; never from characters.

The protocol, and why:
- every request is greedy unless the recipe says otherwise (checks.sampling), so the server and the
  baseline decode the same tokens, and the token count does not hang on a server's default sampling;
- round 1 fixes N, the tokens the server produced; every later round asks the server for N, and the
  baseline decodes exactly N of the same prompt: the same work on both sides;
- rounds alternate server, baseline, server, baseline, … (speed_rounds each, 3 by default): a host whose
  load drifts over minutes moves both sides alike instead of favouring whichever ran in the quiet minute;
  each side's figure is the median of its rounds, and the spread (max − min) / median is recorded;
- the host is sampled in an idle window before and after the rounds (nothing of ours working: everyone
  else's CPU use) and during every round (CPU pressure: tasks waiting for a core while we time).
The verdict is "inconclusive", neither pass nor fail, when (thresholds: gate.DEFAULT_LIMITS speed_*_max, recorded in
the evidence as inconclusive_when):
- the host is busy: other programs used more than speed_idle_busy_max (25 %) of the CPUs in an idle window, or tasks
  waited for a CPU more than speed_pressure_max (20 %) of the timed rounds' time (median round). On this 2-core box
  one CPU hog already exceeds both; a quiet box reads a few per cent. Judged only where this host's load can slow
  what is timed: an endpoint on this machine (hostload.runs_here), or a baseline run here; for a server on another
  machine the load is recorded (host_idle_windows, judged: false) and the rounds decide;
- a side's rounds spread more than speed_spread_max (20 %) and the spread could flip the verdict (some server round
  on each side of the floor, or the rounds of the two sides interleaved): a rate known to ±10 % cannot carry a floor
  or a ratio finer than that (the issue that prompted this saw 11.7 and 16.7 tok/s for the same baseline, 40 %),
  but every round of a 3.5x win beats every round of its baseline whatever the spread;
- the two sides' rounds overlap: faster/slower is claimed only when every server round beats (or loses
  to) every baseline round. With 3 rounds each, two equally fast programs give such a split by chance
  with probability 2/20 -- the extreme of a Mann-Whitney rank test, p = 0.05 each way.
- a round's stream cannot time a decode: one arrival carried more than half of its text chunks (a server or proxy
  held them back: a stream buffered to its end arrives in one piece, and its first-to-last span times nothing), or
  the server's usage disagrees with the streamed text counted again by its tokenizer (USAGE_SLACK). Streams are read
  as they arrive whatever their framing (chunked, Content-Length, or close-delimited as HTTP/1.0 servers send them).
A baseline that cannot run on this machine is reported as not run, and the floor alone decides.
"""
from __future__ import annotations

import secrets
import statistics

from tool.checks import baseline as bl
from tool.checks import filler, hostload
from tool.checks.client import Answer, ClientError
from tool.checks.gate import GateContext, fail, inconclusive, ok
from tool.checks.stream_timing import time_stream

PROMPT = "Write a 600-word story about a lighthouse keeper who finds a message in a bottle."
MESSAGES = [{"role": "user", "content": PROMPT}]

RATIO_RULE = "every server round beats every baseline round (or loses to every one)"
# (factor, tokens): the usage and the streamed text's own count disagree when the larger exceeds factor × the smaller
# + tokens (tool.checks.speed._usage_disagrees says why this much room)
USAGE_SLACK = (2.0, 8)


def thresholds(limits: dict) -> dict:
    return {"spread_max": limits["speed_spread_max"], "idle_cpu_busy_max": limits["speed_idle_busy_max"],
            "round_cpu_pressure_some_max": limits["speed_pressure_max"], "ratio": RATIO_RULE,
            "stream_one_piece": "one arrival carried more than half of a round's text chunks",
            "usage_vs_streamed": f"the larger count > {USAGE_SLACK[0]:g} x the smaller + {USAGE_SLACK[1]} tokens"}


def _round(ctx: GateContext, max_tokens: int, window: float | None, label: str) -> dict:
    """One timed server stream → its figures (decode_tps None with decode_error when it cannot be timed)."""
    body = ctx.body(MESSAGES, max_tokens, stream_options={"include_usage": True})

    def on_text(a):
        if a.t_first is not None:
            ctx.reporter.progress(f"{label}: {a.chunks} chunks", completed=min(a.t_last - a.t_first, window or 0),
                                  total=window)
    h0 = hostload.snapshot()
    a = ctx.client.stream_chat(body, window_s=window, on_text=on_text)
    host = hostload.between(h0, hostload.snapshot())
    n = (a.usage or {}).get("completion_tokens") if not a.cut_at_deadline else None
    source = "usage.completion_tokens"
    if not isinstance(n, int):
        counter = ctx.token_counter()
        n, source = counter.count_text(a.reasoning + a.content), counter.text_source
    r = {"decode_tps": None, "completion_tokens": n, "completion_tokens_source": source, "ttft_s": a.ttft_s,
         "finish_reason": a.finish_reason, "chunks": a.chunks, "cut_at_window": a.cut_at_deadline,
         "cpu_pressure_some": host["cpu_pressure_some"], "cpu_busy": host["cpu_busy"], "loadavg": host["loadavg"]}
    r.update(pieces=a.pieces, largest_piece=a.largest_piece)
    timed, lost = time_stream(a, n), a.timings_lost()     # a stream in one piece has no span at all to time
    if timed is None and lost is None:
        r["decode_error"] = f"too little was streamed to time decode ({n} tokens in {a.chunks} chunks)"
        return r
    if timed is not None:
        r["decode_span_s"] = round(a.t_last - a.t_first, 4)
    untimed = lost or (_usage_disagrees(ctx, a, n) if source == "usage.completion_tokens" else None)
    if untimed:
        # a figure that cannot be trusted is kept for the record, never judged
        r.update(untimed=untimed, decode_error=untimed, untimed_decode_tps=round(timed[0], 3) if timed else None)
    else:
        r["decode_tps"] = round(timed[0], 3)
    return r


def _usage_disagrees(ctx: GateContext, a: Answer, n: int) -> str | None:
    """Why the server's usage cannot count what it streamed, or None. The streamed text is counted again by the
    server's own tokenizer; decoding and re-tokenizing moves a count a little (a random model's byte soup by up
    to 1.7x, seen on the engine's tiny checkpoints), so only a gap beyond USAGE_SLACK says the usage is not this
    stream's (a proxy's, a cached answer's, a miscount): the rate would then be wrong by that factor."""
    counter = ctx.token_counter()
    try:
        counted = counter.count_text(a.reasoning + a.content)
    except ClientError:
        return None          # no second opinion to be had: the usage stands, as before this check
    factor, extra = USAGE_SLACK
    if max(n, counted) <= factor * min(n, counted) + extra:
        return None
    return (f"the usage says {n} completion tokens, but the streamed text counts {counted} by {counter.text_source} "
            f"({a.chunks} text chunks): the usage is not this stream's, so decode cannot be counted")


def _baseline_round(ctx: GateContext, base, tokens: int) -> dict:
    h0 = hostload.snapshot()
    r = base.measure(MESSAGES, tokens, ctx.sampling)
    host = hostload.between(h0, hostload.snapshot())
    return {**r, "decode_tps": round(r["decode_tps"], 3), "cpu_pressure_some": host["cpu_pressure_some"],
            "cpu_busy": host["cpu_busy"], "loadavg": host["loadavg"]}


def prefill(ctx: GateContext, figures: dict) -> None:
    """A long prompt's time to first token. A random lead line keeps a prefix cache from answering."""
    target = ctx.limits["prefill_tokens"]
    counter = ctx.token_counter()
    lead = f"Session {secrets.token_hex(4)}."
    per_word = counter.count_text(filler.build(200)) / 200
    text = filler.build(max(1, int(target / per_word)), lead=lead)
    body = ctx.body([{"role": "user", "content": f"{text}\n\nSummarise the text above in one word."}], 1,
                    stream_options={"include_usage": True})
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


def spread(values: list[float]) -> float | None:
    return round((max(values) - min(values)) / statistics.median(values), 3) if len(values) > 1 else None


def run(ctx: GateContext) -> dict:
    floor = float(ctx.checks.get("decode_floor_tps", 15))
    rounds = max(1, int(ctx.limits["speed_rounds"]))
    idle_s = float(ctx.limits["speed_idle_window_s"])
    figures: dict = {"decode_floor_tps": floor, "decode_tps": None, "prefill_tps": None,
                     "rounds_each": rounds, "inconclusive_when": thresholds(ctx.limits)}
    ctx.reporter.progress(f"sampling the host for {idle_s:g} s while nothing of ours works")
    host = figures["host_idle_windows"] = {"before": hostload.idle_window(idle_s)}
    base = None
    try:
        # untimed: the first decode after load pays for allocations a user's steady state does not
        ctx.client.chat(ctx.body(MESSAGES, 8))
        if ctx.baseline is not None:
            try:
                base = bl.open_baseline(ctx.baseline, ctx.served_name, ctx.context_window,
                                        ctx.limits["request_timeout_s"])
                figures["baseline"] = {**base.describe(), "status": "run", "rounds": []}
            except bl.BaselineUnavailable as e:
                figures["baseline"] = {"label": bl.label_of(ctx.baseline), "status": "not run", "reason": str(e)}
            except bl.BaselineError as e:
                figures["baseline"] = {"label": bl.label_of(ctx.baseline), "status": "failed", "reason": str(e)}
                return fail(f"the baseline ({bl.label_of(ctx.baseline)}) failed to start: {e}", **figures)
        # this host's load can slow only what runs on it: the server, when its endpoint is here, or the baseline
        host["judged"] = hostload.runs_here(ctx.client.base) or base is not None
        if not host["judged"]:
            host["not_judged"] = (f"{ctx.client.base} runs on another machine, which this host's load cannot slow, "
                                  "and no baseline runs here: the load is recorded, not judged")
        if busy := _busy(host, ctx.limits):
            # found out first, cheaply: on an oversubscribed box a decode can run 100x slower (llama.cpp's
            # spinning threads, seen here at 0.5 tok/s), so one windowed round is kept for the record and
            # neither the baseline nor the long prefill is run for figures nobody may judge
            r = _round(ctx, min(ctx.limits["speed_max_tokens"], ctx.context_window // 4), ctx.limits["speed_window_s"],
                       "decoding, one round on a busy host")
            figures["rounds"] = [r]
            figures.update(completion_tokens=r["completion_tokens"], completion_tokens_source=r["completion_tokens_source"],
                           ttft_s=r["ttft_s"])
            if base is not None:
                figures["baseline"].update(status="not run", reason="the host was busy before the rounds")
                figures["baseline"].pop("rounds", None)
            figures = _summary(figures, [r], None, host)
            shown = f"; decode {figures['decode_tps']:.1f} tok/s (one round) is not judged" if figures["decode_tps"] else \
                f"; and {r['untimed']}" if "untimed" in r else ""
            return inconclusive(f"host busy: {busy}{shown}", **figures)
        return _rounds(ctx, base, floor, rounds, figures, host, idle_s)
    except ClientError as e:
        return fail(f"decode: {e}", **figures)
    finally:
        if base is not None:
            base.close()


def _rounds(ctx, base, floor, rounds, figures, host, idle_s) -> dict:
    window = ctx.limits["speed_window_s"]
    max_tokens = min(ctx.limits["speed_max_tokens"], ctx.context_window // 4)
    server_rounds = figures["rounds"] = []
    base_rounds = figures["baseline"]["rounds"] if base is not None else None
    n = None
    for i in range(rounds):
        r = _round(ctx, n or max_tokens, window, f"decoding, round {i + 1}/{rounds}")
        server_rounds.append(r)
        if r["decode_tps"] is None:
            figures["decode_error"] = r["decode_error"]
            if "untimed" in r:              # its tokens were counted, only their timing is not to be trusted
                figures.update(untimed=r["untimed"], completion_tokens=r["completion_tokens"],
                               completion_tokens_source=r["completion_tokens_source"])
            break
        if n is None:
            n = r["completion_tokens"]
            figures.update(completion_tokens=n, completion_tokens_source=r["completion_tokens_source"],
                           ttft_s=r["ttft_s"], decode_finish_reason=r["finish_reason"],
                           decode_cut_at_window=r["cut_at_window"])
        if base is not None:
            ctx.reporter.progress(f"timing {base.label} on the same {n} tokens, round {i + 1}/{rounds}")
            try:
                base_rounds.append(_baseline_round(ctx, base, n))
            except bl.BaselineUnavailable as e:      # found out on its first round (e.g. its GGUF is not here)
                figures["baseline"].update(status="not run", reason=str(e))
                figures["baseline"].pop("rounds", None)
                base = base_rounds = None
            except bl.BaselineError as e:
                figures["baseline"].update(status="failed", reason=str(e))
                host["after"] = hostload.idle_window(idle_s)
                figures = _summary(figures, server_rounds, base_rounds, host)
                if busy := _busy(host, ctx.limits):      # e.g. it timed out on a box shared with a build
                    return inconclusive(f"host busy: {busy}; the baseline ({base.label}) gave no figure: {e}",
                                        **figures)
                return fail(f"decode {_med(server_rounds):.1f} tok/s, but the baseline ({base.label}) failed: {e}",
                            **figures)
    try:
        prefill(ctx, figures)
    except ClientError as e:     # prefill is reported, not gated
        figures["prefill_error"] = str(e)
    host["after"] = hostload.idle_window(idle_s)
    figures = _summary(figures, server_rounds, base_rounds, host)
    if "untimed" in figures:      # before any figure is judged: one round that lied leaves the others suspect
        return inconclusive(f"round {len(server_rounds)}: {figures['untimed']}", **figures)
    if figures["decode_tps"] is None:
        return fail(figures["decode_error"], **figures)
    tps = figures["decode_tps"]

    spread_max = ctx.limits["speed_spread_max"]
    if busy := _busy(host, ctx.limits):
        return inconclusive(f"host busy: {busy}; decode {tps:.1f} tok/s (median of {len(server_rounds)}) "
                            f"is not judged", **figures)
    noisy = [f"{who}'s {len(rs)} rounds spread {s:.0%}" for who, rs, s in
             (("the server", server_rounds, figures["decode_spread"]),
              ("the baseline", base_rounds or [], figures.get("baseline_decode_spread")))
             if s is not None and s > spread_max]
    s_all = [r["decode_tps"] for r in server_rounds]
    b_all = [r["decode_tps"] for r in base_rounds or []]
    # Noise makes a verdict meaningless only where it could flip it: every server round on one side of the floor
    # and (with a baseline) of every baseline round is a verdict no spread changes.
    robust = (min(s_all) >= floor or max(s_all) < floor) and \
        (base is None or not b_all or min(s_all) > max(b_all) or max(s_all) <= min(b_all))
    if noisy and not robust:
        return inconclusive(f"too noisy: {' and '.join(noisy)} (over {spread_max:.0%}); decode {tps:.1f} tok/s "
                            f"is not judged", **figures)
    if tps < floor:
        return fail(f"decode {tps:.1f} tok/s is under the floor of {floor:g}", **figures)
    if base is None:
        why = (figures.get("baseline") or {}).get("reason")
        tail = f" (baseline not run: {why})" if why else ""
        return ok(f"decode {tps:.1f} tok/s ≥ the floor of {floor:g}{tail}", **figures)
    b = figures["baseline_decode_tps"]
    s_vals = [r["decode_tps"] for r in server_rounds]
    b_vals = [r["decode_tps"] for r in base_rounds]
    ratio = figures["vs_baseline"]
    than = (f"{base.label}: {b:.1f} tok/s on the same prompt and {figures['completion_tokens']} tokens, "
            f"medians of {len(s_vals)} interleaved rounds")
    if min(s_vals) > max(b_vals):
        return ok(f"decode {tps:.1f} tok/s ≥ the floor of {floor:g} and {ratio:.2f}× {than}", **figures)
    if max(s_vals) <= min(b_vals):
        return fail(f"decode {tps:.1f} tok/s is not faster than {than} ({ratio:.2f}×)", **figures)
    return inconclusive(f"within the noise: the server's rounds {min(s_vals):.1f}–{max(s_vals):.1f} tok/s overlap "
                        f"the baseline's {min(b_vals):.1f}–{max(b_vals):.1f} ({ratio:.2f}× {than})", **figures)


def _med(rounds: list[dict]) -> float:
    return statistics.median([r["decode_tps"] for r in rounds if r["decode_tps"] is not None] or [0.0])


def _summary(figures: dict, server_rounds: list[dict], base_rounds: list[dict] | None, host: dict) -> dict:
    timed = [r["decode_tps"] for r in server_rounds if r["decode_tps"] is not None]
    figures.update(decode_tps=round(statistics.median(timed), 2) if timed else None,
                   decode_tps_rounds=timed, decode_spread=spread(timed) if timed else None)
    sources = sorted({r["completion_tokens_source"] for r in server_rounds})
    figures["token_source"] = ", ".join(sources) if sources else "none"
    pressures = [r["cpu_pressure_some"] for r in server_rounds + (base_rounds or [])
                 if r.get("cpu_pressure_some") is not None]
    host["rounds_cpu_pressure_some_median"] = round(statistics.median(pressures), 3) if pressures else None
    if base_rounds:
        b = [r["decode_tps"] for r in base_rounds]
        figures.update(baseline_decode_tps=round(statistics.median(b), 2), baseline_decode_tps_rounds=b,
                       baseline_decode_spread=spread(b))
        if figures["decode_tps"]:
            figures["vs_baseline"] = round(figures["decode_tps"] / figures["baseline_decode_tps"], 3)
    return figures


def _busy(host: dict, limits: dict) -> str | None:
    if not host.get("judged", True):
        return None
    why = []
    idle_max, pressure_max = limits["speed_idle_busy_max"], limits["speed_pressure_max"]
    for when in ("before", "after"):
        w = host.get(when) or {}
        if w.get("cpu_busy") is not None and w["cpu_busy"] > idle_max:
            why.append(f"other programs kept {w['cpu_busy']:.0%} of the CPUs busy in the idle window {when} "
                       f"the rounds (over {idle_max:.0%})")
    p = host.get("rounds_cpu_pressure_some_median")
    if p is not None and p > pressure_max:
        why.append(f"tasks waited for a CPU {p:.0%} of the timed rounds' time (median round, over {pressure_max:.0%})")
    return "; ".join(why) or None

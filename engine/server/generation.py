"""One generation as the server runs it: the engine's tokens → the event loop → text, with stop strings.

The engine's scheduler thread hands each token to the request's sink (LLM.submit). The sink here does
not wake a thread per request: a Courier, one per event loop, collects what the scheduler delivers and
wakes the loop once for all that arrived meanwhile (a decode step of four streams is one wake-up, not
four thread hand-offs and four), so the loop's work stays off the scheduler's way. When the client goes
away the async side cancels the request; the scheduler frees its slot at its next turn.
"""
from __future__ import annotations

import asyncio
import threading
import time
import weakref
from dataclasses import dataclass, field

from engine.server.detok import Detokenizer
from engine.server.metrics import Metrics
from engine.server.parsers import StopMatcher


class Courier:
    """Deliveries from the scheduler thread into one event loop's queues, one wake-up per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.waiting: list[tuple[asyncio.Queue, object]] = []

    def deliver(self, to: asyncio.Queue, item) -> None:
        with self.lock:
            wake = not self.waiting
            self.waiting.append((to, item))
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._hand_out)
            except RuntimeError:        # the loop is gone (server shutting down): nobody to tell
                pass

    def _hand_out(self) -> None:
        with self.lock:
            items, self.waiting = self.waiting, []
        for to, item in items:
            to.put_nowait(item)


_couriers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # event loop → its Courier


def courier() -> Courier:
    loop = asyncio.get_running_loop()
    if (c := _couriers.get(loop)) is None:
        c = _couriers[loop] = Courier(loop)
    return c


class TokenPump:
    """One request's tokens as an async iterator. Submits at once, so the engine's eager refusals
    (ValueError, Overloaded) are raised here, before any response starts."""

    def __init__(self, llm, prompt_ids: list[int], params):
        self.queue: asyncio.Queue = asyncio.Queue()
        c, q = courier(), self.queue
        self.submitted = llm.submit(prompt_ids, params, sink=lambda item: c.deliver(q, item))
        self.ended = False

    def cancel(self):
        if not self.ended:
            self.ended = True
            self.submitted.cancel()

    def __del__(self):                  # never iterated (another prompt of its request was refused)
        if not getattr(self, "ended", True):
            self.submitted.cancel(wake=False)

    async def __aiter__(self):
        try:
            while not self.ended:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.ended = True
                    raise item
                if item.finish is not None:
                    self.ended = True
                yield item
        finally:
            self.cancel()               # synchronous on purpose: runs even inside a cancelled task


@dataclass
class Outcome:
    completion_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    started: float = field(default_factory=time.perf_counter)
    # Where the request asked: each answer token's (id, TokenLogprob) as it arrives (an eos/stop id, never shown,
    # has none), and the prompt's (engine.request.Token.prompt), the first None.
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None


async def generate_text(pump: TokenPump, tokenizer, *, stops, hidden, metrics: Metrics, endpoint: str,
                        outcome: Outcome, show: bool = True):
    """Yield the answer's text in chunks from `pump`'s tokens; `outcome` holds the counts and finish
    reason when it ends, and the logprobs of the tokens so far (each yield's tokens are in before it).
    show=False (completions' max_tokens 0, echo's prompt logprobs alone): the first token is taken for its prompt
    logprobs and dropped; nothing is yielded and the answer ends by length."""
    detok = Detokenizer(tokenizer, hidden)
    stop = StopMatcher(stops)
    metrics.queued.inc()
    state = "queued"
    try:
        async for tok in pump:
            if state == "queued":
                outcome.first_token_at = time.perf_counter()
                metrics.ttft_seconds.labels(endpoint).observe(outcome.first_token_at - outcome.started)
                metrics.queued.dec()
                metrics.running.inc()
                state = "running"
            if tok.prompt is not None:
                outcome.prompt_logprobs = tok.prompt
            if not show:
                outcome.finish_reason = "length"
                return
            outcome.completion_tokens += 1
            if tok.logprob is not None and tok.finish != "stop":
                outcome.logprobs.append((tok.id, tok.logprob))
            text = "" if tok.finish == "stop" else detok.add(tok.id)
            if tok.finish == "length":
                text += detok.finish()
            if text and (shown := stop.feed(text)):
                yield shown
            if stop.stopped:
                outcome.finish_reason = "stop"
                return
            if tok.finish:
                outcome.finish_reason = tok.finish
                break
        tail = stop.feed(detok.finish())
        if not stop.stopped:
            tail += stop.finish()
        if tail:
            yield tail
        outcome.finish_reason = outcome.finish_reason or "stop"
    finally:
        pump.cancel()
        (metrics.queued if state == "queued" else metrics.running).dec()

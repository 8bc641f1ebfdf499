"""One generation as the server runs it: LLM.stream in its own thread → text, with stop strings.

LLM.stream is a blocking generator. A thread per generation iterates it and hands tokens to
the event loop through a queue, so the loop never blocks and any number of clients wait at
once. When the client goes away the async side sets a flag; the thread sees it at the next
token and closes the engine's generator (in the thread that runs it), which frees the slot.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.server.detok import Detokenizer
from engine.server.metrics import Metrics
from engine.server.parsers import StopMatcher

_END = object()


class TokenPump:
    def __init__(self, tokens: Iterator):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(tokens,), daemon=True, name="kiln-generation")
        self.thread.start()

    def _run(self, gen):
        try:
            for tok in gen:
                self._put(tok)
                if tok.finish or self.cancelled.is_set():
                    break
        except BaseException as e:      # handed to the request, which answers with it
            self._put(e)
        finally:
            gen.close()             # in the thread that ran it; frees the engine's slot if cut short
            self._put(_END)

    def _put(self, item):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:            # the loop is gone (server shutting down): nobody to tell
            self.cancelled.set()

    def cancel(self):
        self.cancelled.set()

    async def __aiter__(self):
        try:
            while (item := await self.queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()               # synchronous on purpose: runs even inside a cancelled task


@dataclass
class Outcome:
    completion_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    started: float = field(default_factory=time.perf_counter)


async def generate_text(tokens: Iterator, tokenizer, *, stops, hidden, metrics: Metrics, endpoint: str,
                        outcome: Outcome):
    """Yield the answer's text in chunks from `tokens` (an LLM.stream not yet started);
    `outcome` holds the counts and finish reason when it ends."""
    detok = Detokenizer(tokenizer, hidden)
    stop = StopMatcher(stops)
    pump = TokenPump(tokens)
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
            outcome.completion_tokens += 1
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

"""Server-sent events for chat and completions: each chunk a `data:` event under its answer's head (Chunks), a
failure after the headers an error event, `data: [DONE]` last (event_stream), in a response that always closes
its generator, so a client that hangs up stops its generation (EventStream)."""
from __future__ import annotations

import json
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from engine.server.errors import failure
from engine.server.metrics import Metrics


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class Chunks:
    """The streamed bodies of one answer: each choice under the answer's head; with include_usage every
    chunk says usage null and a last one, without choices, carries it (OpenAI's stream_options)."""

    head: dict
    object: str
    include_usage: bool

    def chunk(self, choice: dict) -> dict:
        body = {**self.head, "object": self.object, "choices": [{"index": 0, **choice}]}
        return {**body, "usage": None} if self.include_usage else body

    def usage(self, counts: dict) -> dict:
        return {**self.head, "object": self.object, "choices": [], "usage": counts}


def event_stream(metrics: Metrics, endpoint: str, t0: float, rid: str, chunks: AsyncIterator[dict]) -> EventStream:
    """THE SSE framing of chat and completions: each chunk a `data:` event; a failure after the headers is an
    error event; always `data: [DONE]` last."""
    async def events():
        try:
            async with aclosing(chunks):
                async for body in chunks:
                    yield sse(body)
        except Exception as e:          # after the headers: say so in the stream, then end it
            yield sse(failure(e, rid).body())
        yield "data: [DONE]\n\n"
        metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)
    return EventStream(events())


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed, so a client that hangs up mid-stream
    stops its generation (Starlette cancels the sending task; the close runs the cleanup)."""

    def __init__(self, gen):
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._gen.aclose()

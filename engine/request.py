"""One request as callers and the scheduler share it: what a caller asks (SamplingParams), what it gets back (each
Token, or the RequestFailed that ends it; Overloaded when the queue is full), and the scheduler's record of it
(Request). engine.llm hands them to callers; engine.scheduler works on them."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from engine.sampling import check_params


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0      # 0 (or below engine.sampling.GREEDY_BELOW) → greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()   # in addition to the model's eos ids
    ignore_eos: bool = False

    def check(self) -> None:
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens is {self.max_tokens}; it must be at least 1")
        check_params(self.temperature, self.top_p, self.seed)


class Token(NamedTuple):
    id: int
    finish: str | None            # None, or "stop" (this token is an eos/stop id; do not show it) or "length"


class RequestFailed(RuntimeError):
    """This request's generation failed (its own fault, or the engine closing); other requests go on."""

    def __init__(self, message: str, code: str = "generation_failed"):
        super().__init__(message)
        self.code = code


class Overloaded(RuntimeError):
    """The wait queue is full; retry_after: seconds until a seat is likely free (the server's Retry-After)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Request:
    def __init__(self, prompt: list[int], params: SamplingParams, stops: frozenset[int], generator,
                 sink: Callable[[object], None]):
        self.prompt, self.params, self.stops, self.generator = prompt, params, stops, generator
        self.sink = sink           # called in the scheduler thread: each Token, or the RequestFailed that ends it
        self.cancelled = False     # set by the caller's thread; the scheduler frees the slot
        self.slot = -1
        self.length = 0            # tokens in the KV cache (during prefill: the prompt tokens run so far)
        self.generated = 0
        self.last = -1             # the latest token, fed at the next decode step
        self.submitted = time.monotonic()

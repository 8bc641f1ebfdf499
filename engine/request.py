"""One request as callers and the scheduler share it: what a caller asks (SamplingParams), what it gets back (each
Token, or the RequestFailed that ends it; Overloaded when the queue is full), and the scheduler's record of it
(Request). engine.llm hands them to callers; engine.scheduler works on them."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from engine.logprobs import TokenLogprob, check_top
from engine.sampling import RowSpec, check_params


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0      # 0 (or below engine.sampling.GREEDY_BELOW) → greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()   # in addition to the model's eos ids
    ignore_eos: bool = False
    top_k: int = 0                # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # over the prompt and the output (1: off)
    presence_penalty: float = 0.0     # over the output, as OpenAI's
    frequency_penalty: float = 0.0
    # Log-probabilities (engine.logprobs: the model's log_softmax of the raw logits, before any sampling transform):
    # None: off; N (0..MAX_TOP): each generated token's, with the N most likely at its position.
    logprobs: int | None = None
    # The same for every prompt position after the first (echo's prompt logprobs); such a prompt is prefilled whole,
    # never started after a cached prefix (a reused prefix has no logits).
    prompt_logprobs: int | None = None

    def check(self) -> None:
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens is {self.max_tokens}; it must be at least 1")
        check_params(self.temperature, self.top_p, self.seed, top_k=self.top_k, min_p=self.min_p,
                     repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                     frequency_penalty=self.frequency_penalty)
        check_top(self.logprobs, "logprobs")
        check_top(self.prompt_logprobs, "prompt_logprobs")


class Token(NamedTuple):
    id: int
    finish: str | None            # None, or "stop" (this token is an eos/stop id; do not show it) or "length"
    logprob: TokenLogprob | None = None     # where the request asked (SamplingParams.logprobs)
    # On the first token only, where the request asked (SamplingParams.prompt_logprobs): one per prompt token, the
    # first None (nothing precedes it).
    prompt: list[TokenLogprob | None] | None = None


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
    def __init__(self, prompt: list[int], params: SamplingParams, stops: frozenset[int], seed: int,
                 sink: Callable[[object], None]):
        self.prompt, self.params, self.stops, self.seed = prompt, params, stops, seed
        self.sink = sink           # called in the scheduler thread: each Token, or the RequestFailed that ends it
        self.cancelled = False     # set by the caller's thread; the scheduler frees the slot
        self.slot = -1
        self.length = 0            # tokens in the KV cache (during prefill: the prompt tokens run so far)
        self.generated = 0
        self.emitted: list[int] = []   # its tokens so far: the KV's positions past the prompt hold emitted[:length - len(prompt)]
        self.last = -1             # the latest token, fed at the next decode step
        self.prompt_lps: list | None = [None] if params.prompt_logprobs is not None else None  # filled by the prefill
        self.submitted = time.monotonic()

    def spec(self, ahead: int = 0) -> RowSpec:
        """The sampler's row for this request's next token (`ahead`: that many tokens after it)."""
        p = self.params
        return RowSpec(p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.presence_penalty,
                       p.frequency_penalty, self.seed, self.generated + ahead)

    def held(self) -> list[int]:
        """The tokens whose positions its KV slot holds: the prompt, then the tokens fed back so far."""
        return (self.prompt + self.emitted)[:self.length]

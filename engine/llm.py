"""LLM: the generation API the server builds on — many callers stream at once, one scheduler thread
runs the model.

Continuous batching in the manner of nano-vllm: each scheduler turn admits at most one waiting
request (its prefill) and then runs ONE decode step for every active sequence, so a long queue
cannot starve the running streams and a new stream waits at most one step per request ahead of it.
Callers never touch the model; they read their tokens from a queue. Closing a stream early frees
its KV slot at the next turn.
"""
from __future__ import annotations

import queue
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from engine.kernels.cpu import set_compute_threads
from engine.loader import load_model
from engine.models.common import MoEModel
from engine.runtime import EngineConfig
from engine.sampling import choose, make_generator


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0      # 0 → greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()   # in addition to the model's eos ids
    ignore_eos: bool = False

    def check(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens is {self.max_tokens}; it must be at least 1")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature is {self.temperature}; it must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p is {self.top_p}; it must be in (0, 1]")


class Token(NamedTuple):
    id: int
    finish: str | None            # None, or "stop" (this token is an eos/stop id; do not show it) or "length"


class _Request:
    def __init__(self, prompt: list[int], params: SamplingParams, stops: frozenset[int], generator):
        self.prompt, self.params, self.stops, self.generator = prompt, params, stops, generator
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False     # set by the caller's thread; the scheduler frees the slot
        self.slot = -1
        self.length = 0            # tokens in the KV cache
        self.generated = 0
        self.last = -1             # the latest token, fed at the next decode step


class LLM:
    def __init__(self, model: MoEModel, tokenizer, model_dir: str | Path | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.model_dir = Path(model_dir) if model_dir else None
        self.model_type: str = model.cfg.arch
        self.max_context: int = model.max_len
        self.eos_token_ids: set[int] = set(model.cfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        self._cv = threading.Condition()
        self._pending: deque[_Request] = deque()
        self._active: list[_Request] = []        # the scheduler thread's own
        self._closed = False
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()
        # An engine nobody closed still stops its scheduler at interpreter exit: a daemon thread that ran
        # OpenMP regions and is still alive when the process exits makes the C++ runtime abort (exit 134).
        weakref.finalize(self, _stop_scheduler, self.__dict__)

    @classmethod
    def load(cls, model_dir, store_dir=None, config: EngineConfig | None = None, **knobs) -> "LLM":
        """The engine as `config` (or keyword knobs: EngineConfig's fields) says. config.threads: CPU compute
        threads (engine.kernels.cpu.set_compute_threads; None: its default), which the scheduler thread takes up
        when it starts. The loading runs on one torch thread so the calling thread keeps no OpenMP team of its
        own: with a second team alive, libgomp throttles its spin-waits and every parallel region of the
        decode pays a futex wake-up (measured: 19 → 14 tok/s on SmolLM2, 2 cores)."""
        from transformers import AutoTokenizer

        config = EngineConfig.of(config, **knobs)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model = load_model(model_dir, store_dir=store_dir, config=config)
        finally:
            torch.set_num_threads(before)
        if config.device_kind == "cpu":
            set_compute_threads(config.threads)  # here, not in the scheduler: a daemon thread that set them aborts the exit
        return cls(model, AutoTokenizer.from_pretrained(model_dir), model_dir)

    # ------------------------------------------------------------ callers' side (any thread)

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Iterator[Token]:
        """Tokens as they are generated; the last one carries finish. Checks eagerly, submits on first next()."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt is empty")
        if len(prompt) >= self.max_context:
            raise ValueError(f"prompt is {len(prompt)} tokens; the context is {self.max_context}")
        vocab = self.model.cfg.vocab_size
        if (bad := next((t for t in prompt if not 0 <= t < vocab), None)) is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        params.check()
        if self._closed:
            raise RuntimeError("the engine is closed")
        return self._stream(prompt, params)

    def _stream(self, prompt: list[int], params: SamplingParams) -> Iterator[Token]:
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
        gen = make_generator(params.seed, self.model.device) if params.temperature > 0 else None
        req = _Request(prompt, params, stops, gen)
        with self._cv:
            self._pending.append(req)
            self._cv.notify()
        done = False
        try:
            while True:
                item = req.out.get()
                if isinstance(item, BaseException):
                    done = True
                    raise RuntimeError(f"generation failed: {item}") from item
                yield item
                if item.finish is not None:
                    done = True
                    return
        finally:
            if not done:                       # closed early (or the caller's thread died): free the slot
                req.cancelled = True
                with self._cv:
                    self._cv.notify()

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> list[Token]:
        return list(self.stream(prompt_ids, params))

    def counters(self) -> dict:
        out = dict(self.model.provider.counters())
        with self._cv:
            out.update(prompt_tokens_total=self._prompt_tokens, generation_tokens_total=self._generation_tokens,
                       active_streams=len(self._active), queued_streams=len(self._pending))
        return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        if close := getattr(self.model.provider, "close", None):
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ the scheduler thread

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._closed or self._pending or self._active):
                        self._cv.wait()
                    if self._closed:
                        break
                    for r in [r for r in self._pending if r.cancelled]:
                        self._pending.remove(r)
                    new = self._pending.popleft() if self._pending and self.model.kv.free_slots() else None
                for r in [r for r in self._active if r.cancelled]:
                    self._retire(r)
                try:
                    if new is not None:
                        self._prefill(new)
                    if self._active:
                        self._decode()
                except Exception as e:          # a failed step fails its streams, not the engine
                    for r in list(self._active) + ([new] if new is not None and new.slot < 0 else []):
                        r.out.put(e)
                        if r.slot >= 0:
                            self._retire(r)
        gone = RuntimeError("the engine is closed")
        for r in list(self._active) + list(self._pending):
            r.out.put(gone)

    def _prefill(self, r: _Request) -> None:
        r.slot = self.model.kv.alloc()
        self._active.append(r)
        logits = self.model.prefill(r.prompt, r.slot)
        r.length = len(r.prompt)
        with self._cv:
            self._prompt_tokens += r.length
        p = r.params
        self._emit(r, choose(logits[None], [p.temperature], [p.top_p], [r.generator])[0])

    def _decode(self) -> None:
        batch = sorted(self._active, key=lambda r: r.slot)     # ascending slots: usually one contiguous view
        logits = self.model.decode_step([r.last for r in batch], [r.slot for r in batch], [r.length for r in batch])
        for r in batch:
            r.length += 1
        tokens = choose(logits, [r.params.temperature for r in batch], [r.params.top_p for r in batch],
                        [r.generator for r in batch])
        for r, t in zip(batch, tokens):
            if not r.cancelled:
                self._emit(r, t)

    def _emit(self, r: _Request, token: int) -> None:
        r.generated += 1
        r.last = token
        with self._cv:
            self._generation_tokens += 1
        if token in r.stops:
            finish = "stop"
        elif r.generated >= r.params.max_tokens or r.length + 1 >= self.max_context:
            finish = "length"                   # max_tokens, or prompt + output fills the context
        else:
            finish = None
        r.out.put(Token(token, finish))
        if finish is not None:
            self._retire(r)

    def _retire(self, r: _Request) -> None:
        self._active.remove(r)
        self.model.kv.release(r.slot)
        r.slot = -1


def _stop_scheduler(state: dict) -> None:
    """LLM's scheduler stop for weakref.finalize (it must not hold the LLM): what close() does to the thread."""
    with state["_cv"]:
        state["_closed"] = True
        state["_cv"].notify()
    if state["_thread"] is not threading.current_thread():
        state["_thread"].join(timeout=10)

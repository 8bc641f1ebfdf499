"""LLM: the generation API the server builds on — many callers stream at once, one scheduler thread
runs the model.

Continuous batching in the manner of nano-vllm, with chunked prefill: each scheduler turn runs at most
ONE prefill chunk (of the one request being prefilled; `chunk_size` tokens) and then ONE decode step
for every running sequence. A long prompt therefore interleaves with the running streams instead of
freezing them: a running stream waits at most one chunk and one step between its tokens. With no stream
decoding there is nobody to wait, and on CUDA a prompt is then prefilled ALONE_CHUNKS chunks at a time: each
chunk pays the host's launches of every layer once, whatever its length.

Every request is its own failure domain: an exception in its prefill, in its sampling (NaN logits) or
in a decode step it took part in ends that request with RequestFailed and the others go on (a failed
batched step is retried one sequence at a time to find whose it was). The queue is bounded: past
`max_queue` waiting requests a new one is refused at once with Overloaded (the server's 429).

Decode ahead: where a decode step launches asynchronously (CUDA, every expert resident: decode_ahead_ok) and
every running sequence is greedy, the step after it is launched from the argmax still on the GPU before the host
reads this step's tokens, so the GPU computes while the host reads, emits and checks stops. A sequence that ends
at that read, or one that joins, leaves the launched step unused: it is run again, from the host's tokens, at the
same positions (its KV writes are simply redone), so the tokens are the step-by-step path's.

Callers never touch the model. stream() hands a caller its tokens through a queue it iterates;
submit() calls the caller's own sink in the scheduler thread instead (the server's: straight into its
event loop, with no thread of its own per request). Closing a stream or cancelling a submitted request
frees its KV slot at the next turn.
"""
from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from engine.kernels.cpu import set_compute_threads
from engine.loader import load_model
from engine.model_source import load_tokenizer, open_checkpoint
from engine.models.common import MoEModel
from engine.runtime import EngineConfig
from engine.sampling import GreedyPicks, SamplingError, check_params, choose, is_greedy, make_generator

DEFAULT_CHUNK = 512            # prefill tokens per scheduler turn (engine serve --chunk-size)
# A CUDA prefill with no stream decoding beside it takes this many chunks a turn: an 8000-token prompt on the H200
# (int4 experts, 4 layers) in 88 ms as 512-token chunks, 48 as 2048 (results/2026-12-03-h200-prefill-kernels-2.json;
# 124 and 51 in -kernels.json, on a slower host).
ALONE_CHUNKS = 4


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


class _Launched(NamedTuple):
    """A decode step on its way: its batch, logits, and (all greedy) its argmax on the device (GreedyPicks)."""
    batch: list
    logits: torch.Tensor
    picks: GreedyPicks | None


class _Request:
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


class Submitted:
    """A request handed to submit(): cancel() (any thread) ends it at the scheduler's next turn."""

    def __init__(self, llm: "LLM", req: _Request):
        self._llm, self._req = llm, req

    def cancel(self, wake: bool = True) -> None:
        """wake=False (from a finalizer, which must not take a lock): the scheduler sees it at its next turn."""
        self._req.cancelled = True
        if wake:
            with self._llm._cv:
                self._llm._cv.notify()


class Stream:
    """One request's tokens, as they are generated; the last one carries finish. Iterating raises
    RequestFailed if the request fails. close() (or dropping it) before the end cancels the request."""

    def __init__(self, submitted: Submitted, out: queue.SimpleQueue):
        self._submitted, self._out, self._done = submitted, out, False

    def __iter__(self):
        return self

    def __next__(self) -> Token:
        if self._done:
            raise StopIteration
        item = self._out.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish is not None:
            self._done = True
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._submitted.cancel()

    def __del__(self):
        if not getattr(self, "_done", True):
            self._submitted.cancel(wake=False)


class LLM:
    def __init__(self, model: MoEModel, tokenizer, model_dir: str | Path | None = None, *,
                 chunk_size: int = DEFAULT_CHUNK, max_queue: int | None = None, decode_ahead: bool = True):
        """chunk_size: prefill tokens per scheduler turn. max_queue: requests waiting for a slot before new
        ones are refused with Overloaded (default 4 × the KV cache's slots). decode_ahead: greedy steps launch
        before the previous one's tokens are read, where the model allows it (model.decode_ahead_ok)."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size {chunk_size} must be at least 1")
        self.model, self.tokenizer = model, tokenizer
        self.model_dir = Path(model_dir) if model_dir else None
        self.model_type: str = model.cfg.arch
        self.max_context: int = model.max_len
        self.max_batch: int = model.kv.slots
        self.chunk_size = chunk_size
        self.alone_chunk = chunk_size * (ALONE_CHUNKS if model.device.type == "cuda" else 1)
        self.max_queue = 4 * self.max_batch if max_queue is None else max_queue
        if self.max_queue < 0:
            raise ValueError(f"max_queue {self.max_queue} must be >= 0")
        self.eos_token_ids: set[int] = set(model.cfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        self._cv = threading.Condition()
        self._pending: deque[_Request] = deque()
        self._prefilling: _Request | None = None   # the scheduler thread's own, as is _active
        self._active: list[_Request] = []
        self._closed = False
        self._abort: str | None = None             # set by abort(): fail everything at the next turn
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._failed = 0
        self._rejected = 0
        self._request_seconds = 1.0                # running mean of a request's time in the engine
        # Where a decode step's launch returns before the GPU computes it, the tokens of one step are handed to the
        # sinks after the next step is launched: the server's event loop then does its per-token work (detokenising,
        # SSE) while the GPU computes, instead of taking the GIL the scheduler needs to launch that step (on the
        # H200 this stall was ~0.3 ms of a 2 ms resident step). Elsewhere each item goes out at once.
        self._defer = model.async_decode
        self._outbox: list[tuple[Callable[[object], None], object]] = []
        self._chain = decode_ahead and model.decode_ahead_ok  # decode ahead (the module's docstring)
        self._ahead: _Launched | None = None                  # the step launched ahead, its tokens not yet read
        self._ahead_used = 0
        self._ahead_redone = 0
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()
        # An engine nobody closed still stops its scheduler at interpreter exit: a daemon thread that ran
        # OpenMP regions and is still alive when the process exits makes the C++ runtime abort (exit 134).
        weakref.finalize(self, _stop_scheduler, self.__dict__)

    @classmethod
    def load(cls, model_dir, store_dir=None, config: EngineConfig | None = None, *, chunk_size: int = DEFAULT_CHUNK,
             max_queue: int | None = None, **knobs) -> "LLM":
        """The engine as `config` (or keyword knobs: EngineConfig's fields) says; chunk_size and max_queue are
        the scheduler's (see LLM). config.threads: CPU compute
        threads (engine.kernels.cpu.set_compute_threads; None: its default), which the scheduler thread takes up
        when it starts. The loading runs on one torch thread so the calling thread keeps no OpenMP team of its
        own: with a second team alive, libgomp throttles its spin-waits and every parallel region of the
        decode pays a futex wake-up (measured: 19 → 14 tok/s on SmolLM2, 2 cores)."""
        from engine.tiers.ram import trim_heap

        config = EngineConfig.of(config, **knobs)
        # The tokenizer first: its load's transients (~14 MB for the demo's) then come and go before the model's
        # weights and RAM tier are resident, not on top of them (the CPU server's peak RSS, bench/demo_memory.py).
        # The checkpoint's own check comes before it, so a directory that is no checkpoint still says so.
        ckpt = open_checkpoint(model_dir)          # a checkpoint directory or a GGUF file, opened once
        tokenizer = load_tokenizer(ckpt)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model = load_model(ckpt, store_dir=store_dir, config=config)
        finally:
            torch.set_num_threads(before)
        if config.device_kind == "cpu":
            set_compute_threads(config.threads)  # here, not in the scheduler: a daemon thread that set them aborts the exit
            trim_heap()                          # what the load freed, back to the kernel (engine.tiers.ram.trim_heap)
        return cls(model, tokenizer, model_dir, chunk_size=chunk_size, max_queue=max_queue,
                   decode_ahead=config.decode_ahead)

    # ------------------------------------------------------------ callers' side (any thread)

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Stream:
        """Submit a request; its tokens as they are generated. Checks eagerly, as submit() does."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        return Stream(self.submit(prompt_ids, params, sink=out.put), out)

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               sink: Callable[[object], None]) -> Submitted:
        """Submit a request whose tokens go to `sink`, called in the scheduler thread with each Token (the last
        carries finish) or the RequestFailed that ends it: it must return at once and never raise. Checks
        eagerly (ValueError: the caller's input; Overloaded: the queue is full; RuntimeError: engine closed)."""
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
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
        gen = None if is_greedy(params.temperature) else make_generator(params.seed, self.model.device)
        req = _Request(prompt, params, stops, gen, sink)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if len(self._pending) >= self.max_queue:
                self._rejected += 1
                wait = self._request_seconds * (len(self._pending) + 1) / self.max_batch
                raise Overloaded(f"the queue is full ({len(self._pending)} requests waiting for {self.max_batch} "
                                 f"running; the limit is {self.max_queue}); retry later",
                                 retry_after=max(1, min(600, math.ceil(wait))))
            self._pending.append(req)
            self._cv.notify()
        return Submitted(self, req)

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> list[Token]:
        return list(self.stream(prompt_ids, params))

    def counters(self) -> dict:
        out = dict(self.model.provider.counters())
        if (graphs := self.model.graphs) is not None:
            out.update(decode_graph_replays=graphs.replays, decode_graph_captures=graphs.captures)
        out.update(decode_ahead_steps_total=self._ahead_used, decode_ahead_redone_total=self._ahead_redone)
        with self._cv:
            out.update(prompt_tokens_total=self._prompt_tokens, generation_tokens_total=self._generation_tokens,
                       active_streams=len(self._active) + (self._prefilling is not None),
                       queued_streams=len(self._pending), failed_requests_total=self._failed,
                       rejected_requests_total=self._rejected)
        return out

    def abort(self, message: str, code: str = "shutting_down") -> None:
        """End every request, running or waiting, with RequestFailed(message) at the scheduler's next turn
        (the server's drain on SIGTERM); requests submitted afterwards run as usual."""
        with self._cv:
            self._abort = (message, code)
            self._cv.notify()

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
                    while not (self._closed or self._abort or self._pending or self._active or self._prefilling):
                        self._cv.wait()
                    if self._closed:
                        break
                    abort, self._abort = self._abort, None
                    for r in [r for r in self._pending if r.cancelled]:
                        self._pending.remove(r)
                    waiting = list(self._pending) if abort else []
                    if abort:
                        self._pending.clear()
                    new = None
                    if not abort and self._prefilling is None and self._pending and self.model.kv.free_slots():
                        new = self._pending.popleft()
                if abort:
                    self._ahead = None
                    for r in self._running() + waiting:
                        self._fail(r, RequestFailed(*abort))
                    self._flush()
                    continue
                for r in [r for r in self._running() if r.cancelled]:
                    self._retire(r)
                if new is not None:
                    new.slot = self.model.kv.alloc()
                    self._prefilling = new
                if self._prefilling is not None:
                    self._prefill_chunk(self._prefilling)
                if self._active:
                    self._decode()
                if not (self._active and self._prefilling is None and not self._pending):
                    self._flush()           # no decode launch comes next to send them behind
        self._flush()
        gone = RequestFailed("the engine is closed", "engine_closed")
        for r in self._running() + list(self._pending):
            r.sink(gone)

    def _running(self) -> list[_Request]:
        return self._active + ([self._prefilling] if self._prefilling is not None else [])

    def _prefill_chunk(self, r: _Request) -> None:
        """The next chunk of r's prompt into its slot; after the last, its first token and it joins the batch."""
        done = r.length
        chunk = r.prompt[done:done + (self.chunk_size if self._active else self.alone_chunk)]
        try:
            logits = self.model.prefill(chunk, r.slot, start=done)
        except Exception as e:              # its own prompt failed: it alone ends
            self._fail(r, RequestFailed(f"generation failed: prefill: {e}"))
            return
        r.length = done + len(chunk)
        with self._cv:
            self._prompt_tokens += len(chunk)
        if r.length < len(r.prompt):
            return
        self._prefilling = None
        self._active.append(r)
        token = choose(logits[None], [r.params.temperature], [r.params.top_p], [r.generator])[0]
        self._emit(r, token)

    def _decode(self) -> None:
        batch = sorted(self._active, key=lambda r: r.slot)     # ascending slots: usually one contiguous view
        step, self._ahead = self._ahead, None
        if step is not None and step.batch == batch:
            self._ahead_used += 1
        elif step is not None:
            self._ahead_redone += 1         # a stream joined or left: run from the host's tokens, same positions
            step = None
        if step is None:
            try:
                logits = self._step(batch)
            except Exception:
                self._flush()
                # Whose was it? The same step, one sequence at a time (it rewrites the same KV positions).
                for r in batch:
                    try:
                        row = self._step([r])
                    except Exception as e:
                        self._fail(r, RequestFailed(f"generation failed: decode: {e}"))
                    else:
                        self._finish_step([r], row)
                return
            step = _Launched(batch, logits, GreedyPicks(logits) if self._chains(batch) else None)
        ahead = None
        if step.picks is not None and self._chains(batch):
            try:
                logits = self.model.decode_step(step.picks.best, [r.slot for r in batch], [r.length + 1 for r in batch])
                ahead = _Launched(batch, logits, GreedyPicks(logits))
            except Exception:
                ahead = None                # the next turn runs that step the ordinary way (and finds whose it was)
        self._flush()                       # the previous step's tokens, while this one computes
        if step.picks is None:
            self._finish_step(batch, step.logits)
            return
        tokens, all_argmax = step.picks.tokens()
        self._finish_tokens(batch, tokens)
        if ahead is not None:
            if all_argmax and all(r.slot >= 0 and not r.cancelled for r in batch):
                self._ahead = ahead         # the next turn uses it, unless a stream joins or leaves first
            else:                           # it fed a token this read did not give, or a sequence ended
                self._ahead_redone += 1

    def _chains(self, batch: list[_Request]) -> bool:
        """Whether the step after this one may launch before this one's tokens are read: the engine decodes ahead,
        every sequence is greedy and none ends by length at this step, and no stream is about to join."""
        if not self._chain or self._prefilling is not None or (self._pending and self.model.kv.free_slots()):
            return False
        return all(is_greedy(r.params.temperature) and r.generated + 1 < r.params.max_tokens
                   and r.length + 2 < self.max_context for r in batch)

    def _step(self, batch: list[_Request]) -> torch.Tensor:
        return self.model.decode_step([r.last for r in batch], [r.slot for r in batch], [r.length for r in batch])

    def _finish_step(self, batch: list[_Request], logits: torch.Tensor) -> None:
        self._finish_tokens(batch, choose(logits, [r.params.temperature for r in batch],
                                          [r.params.top_p for r in batch], [r.generator for r in batch]))

    def _finish_tokens(self, batch: list[_Request], tokens: list) -> None:
        for r in batch:
            r.length += 1
        for r, t in zip(batch, tokens):
            if not r.cancelled:
                self._emit(r, t)

    def _emit(self, r: _Request, token: int | SamplingError) -> None:
        if isinstance(token, SamplingError):
            self._fail(r, RequestFailed(f"generation failed: sampling: {token}"))
            return
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
        self._send(r, Token(token, finish))
        if finish is not None:
            self._retire(r)

    def _send(self, r: _Request, item) -> None:
        if self._defer:
            self._outbox.append((r.sink, item))
        else:
            r.sink(item)

    def _flush(self) -> None:
        """Hand the deferred items to their sinks, in the order they were made."""
        if self._outbox:
            items, self._outbox = self._outbox, []
            for sink, item in items:
                sink(item)

    def _fail(self, r: _Request, e: RequestFailed) -> None:
        self._send(r, e)
        with self._cv:
            self._failed += 1
        if r.slot >= 0:
            self._retire(r)

    def _retire(self, r: _Request) -> None:
        if r is self._prefilling:
            self._prefilling = None
        else:
            self._active.remove(r)
        self.model.kv.release(r.slot)
        r.slot = -1
        with self._cv:
            self._request_seconds += 0.2 * (time.monotonic() - r.submitted - self._request_seconds)


def _stop_scheduler(state: dict) -> None:
    """LLM's scheduler stop for weakref.finalize (it must not hold the LLM): what close() does to the thread."""
    with state["_cv"]:
        state["_closed"] = True
        state["_cv"].notify()
    if state["_thread"] is not threading.current_thread():
        state["_thread"].join(timeout=10)

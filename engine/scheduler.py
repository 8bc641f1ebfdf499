"""The scheduler: one thread runs the model for every request — continuous batching in the manner of nano-vllm, with
chunked prefill.

Each turn runs at most ONE prefill chunk (of the one request being prefilled; `chunk_size` tokens) and then ONE
decode step for every running sequence. A long prompt therefore interleaves with the running streams instead of
freezing them: a running stream waits at most one chunk and one step between its tokens. With no stream decoding
there is nobody to wait, and on CUDA a prompt is then prefilled ALONE_CHUNKS chunks at a time: each chunk pays the
host's launches of every layer once, whatever its length. Where the model allows it, a batch's next step is
launched before this one's tokens are read (engine.decode_ahead). A new prompt starts after the longest prefix a
slot already holds and can resume from (engine.prefix_cache), unless it asked for its prompt's logprobs (then every position is
prefilled, each chunk's logits kept). A step's rows that asked for logprobs get them from a table made on the device
before the next step launches (engine.logprobs); rows that did not ask cost nothing, and decode ahead goes on.

Every request is its own failure domain: an exception in its prefill, in its sampling (NaN logits) or in a decode
step it took part in ends that request with RequestFailed and the others go on (a failed batched step is retried
one sequence at a time to find whose it was). The queue is bounded: past `max_queue` waiting requests a new one is
refused at once with Overloaded (the server's 429). A cancelled request's KV slot is freed at the next turn.

The callers' side (LLM: submit, stream, counters) is engine.llm; it shares this class's lock (`_cv`) and queue.
"""
from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch

from engine.decode_ahead import DecodeAhead, Launched, decode_picks, may_chain
from engine.engine_config import EngineConfig
from engine.logprobs import LogprobTable, TokenLogprob, token_logprobs
from engine.models.common import MoEModel
from engine.prefix_cache import PrefixCache
from engine.request import Overloaded, Request, RequestFailed, Token
from engine.sampling import Penalties, RowSpec, SamplingError, choose

# A CUDA prefill with no stream decoding beside it takes this many chunks a turn: an 8000-token prompt on the H200
# (int4 experts, 4 layers) in 88 ms as 512-token chunks, 48 as 2048 (results/2026-12-03-h200-prefill-kernels-2.json;
# 124 and 51 in -kernels.json, on a slower host).
ALONE_CHUNKS = 4


class Scheduler:
    def __init__(self, model: MoEModel, config: EngineConfig):
        """config.chunk_size: prefill tokens per turn; config.max_queue: requests waiting for a slot before new ones
        are refused with Overloaded (None: 4 × the KV cache's slots); config.decode_ahead: greedy steps launch before
        the previous one's tokens are read, where the model allows it (model.decode_ahead_ok)."""
        self.model = model
        self.max_context: int = model.max_len
        self.max_batch: int = model.caches.slots
        self.chunk_size = config.chunk_size
        self.alone_chunk = config.chunk_size * (ALONE_CHUNKS if model.device.type == "cuda" else 1)
        self.max_queue = 4 * self.max_batch if config.max_queue is None else config.max_queue
        self._cv = threading.Condition()
        self._pending: deque[Request] = deque()
        self._prefilling: Request | None = None    # the scheduler thread's own, as is _active
        self._active: list[Request] = []
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
        self._chain = config.decode_ahead and model.decode_ahead_ok   # decode ahead (engine.decode_ahead)
        self._ahead = DecodeAhead(model.caches)
        self._prefix = PrefixCache(model.caches) if config.prefix_cache and model.caches.reusable_prefix else None
        self._penalties: Penalties | None = None       # made at the first request that asks for a penalty
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()
        # An engine nobody closed still stops its scheduler at interpreter exit: a daemon thread that ran
        # OpenMP regions and is still alive when the process exits makes the C++ runtime abort (exit 134).
        weakref.finalize(self, _stop_scheduler, self.__dict__)

    # ------------------------------------------------------------ from the callers' threads

    def _enqueue(self, req: Request) -> None:
        """Queue `req` for a slot: RuntimeError once closed, Overloaded when max_queue requests already wait."""
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

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _scheduler_counters(self) -> dict:
        out = dict(decode_ahead_steps_total=self._ahead.used, decode_ahead_redone_total=self._ahead.redone)
        if self._prefix is not None:
            out.update(self._prefix.counters())
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

    def _stop(self) -> None:
        """End the scheduler thread; requests still running or waiting get RequestFailed (engine_closed)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

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
                    if not abort and self._prefilling is None and self._pending and self.model.caches.free_slots():
                        new = self._pending.popleft()
                if abort:
                    self._ahead.drop()
                    for r in self._running() + waiting:
                        self._fail(r, RequestFailed(*abort))
                    self._flush()
                    continue
                for r in [r for r in self._running() if r.cancelled]:
                    self._retire(r)
                if new is not None:
                    if self._prefix is None:
                        new.slot = self.model.caches.alloc()
                    else:           # prompt logprobs need every position's logits: no reused prefix
                        new.slot, new.length = self._prefix.admit(new.prompt,
                                                                  reuse=new.params.prompt_logprobs is None)
                        with self._cv:
                            self._prompt_tokens += new.length     # a prompt's tokens count, prefilled or reused
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

    def _running(self) -> list[Request]:
        return self._active + ([self._prefilling] if self._prefilling is not None else [])

    def _prefill_chunk(self, r: Request) -> None:
        """The next chunk of r's prompt into its slot; after the last, its first token and it joins the batch."""
        done = r.length
        chunk = r.prompt[done:done + (self.chunk_size if self._active else self.alone_chunk)]
        try:
            if r.prompt_lps is None:
                logits = self.model.prefill(chunk, r.slot, start=done)
            else:                           # every position's logits: each predicts the prompt's next token
                every = self.model.prefill(chunk, r.slot, start=done, all_logits=True)
                logits, n = every[-1], min(len(chunk), len(r.prompt) - 1 - done)
                r.prompt_lps += token_logprobs(every[:n], r.prompt[done + 1:done + 1 + n],
                                               [r.params.prompt_logprobs] * n)
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
        if self._prefix is not None:
            self._prefix.publish(r.slot, r.prompt)
        spec = r.spec()
        if spec.penalised:
            if self._penalties is None:
                self._penalties = Penalties(self.max_batch, logits.shape[-1], logits.device)
            self._penalties.reset(r.slot, r.prompt)
        token = choose(logits[None], [spec], **self._penalised([r], [spec]))[0]
        lp = self._logprobs([r], logits[None], [token]) if r.params.logprobs is not None else None
        self._emit(r, token, lp[0] if lp else None)

    def _decode(self) -> None:
        batch = sorted(self._active, key=lambda r: r.slot)     # ascending slots: usually one contiguous view
        step = self._ahead.take(batch)
        if step is None:
            specs = [r.spec() for r in batch]
            pen = self._penalties if any(s.penalised for s in specs) else None
            try:
                if self._chains(batch) or self.model.graphs is not None:
                    # chosen on the device (in the sampler graph after the step's, where the model has one)
                    logits, picks = decode_picks(self.model, [r.last for r in batch], [r.slot for r in batch],
                                                 [r.length for r in batch], specs, pen)
                else:
                    logits, picks = self._step(batch), None
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
            step = Launched(batch, logits, picks, table(logits, batch) if picks is not None else None)
        ahead = self._ahead.launch(self.model, step) if step.picks is not None and self._chains(batch) else None
        self._flush()                       # the previous step's tokens, while this one computes
        if step.picks is None:
            self._finish_step(batch, step.logits)
            return
        tokens, all_final = step.picks.tokens()
        self._finish_tokens(batch, tokens, step.table.read(tokens) if step.table is not None else None)
        self._ahead.keep(ahead, all_final)

    def _chains(self, batch: list[Request]) -> bool:
        """Whether the step after this one may launch before this one's tokens are read: the engine decodes ahead,
        no sequence is penalised and none ends by length at this step, and no stream is about to join."""
        if not self._chain or self._prefilling is not None or (self._pending and self.model.caches.free_slots()):
            return False
        return may_chain(batch, self.max_context)

    def _step(self, batch: list[Request]) -> torch.Tensor:
        return self.model.decode_step([r.last for r in batch], [r.slot for r in batch], [r.length for r in batch])

    def _finish_step(self, batch: list[Request], logits: torch.Tensor) -> None:
        specs = [r.spec() for r in batch]
        tokens = choose(logits, specs, **self._penalised(batch, specs))
        self._finish_tokens(batch, tokens, self._logprobs(batch, logits, tokens))

    @staticmethod
    def _logprobs(batch: list[Request], logits: torch.Tensor, tokens: list) -> list[TokenLogprob | None] | None:
        """The logprobs of the rows that asked for them (engine.logprobs); None, at no cost, where none did."""
        t = table(logits, batch)
        return t.read(tokens) if t is not None else None

    def _penalised(self, batch: list[Request], specs: list[RowSpec]) -> dict:
        """sample()'s penalty arguments for a batch with a penalised row (their slots' counts), else none."""
        if not any(s.penalised for s in specs):
            return {}
        return {"penalties": self._penalties, "slots": torch.tensor([r.slot for r in batch], device=self.model.device)}

    def _finish_tokens(self, batch: list[Request], tokens: list, lps: list | None = None) -> None:
        for r in batch:
            r.length += 1
        for i, (r, t) in enumerate(zip(batch, tokens)):
            if not r.cancelled:
                self._emit(r, t, lps[i] if lps is not None else None)

    def _emit(self, r: Request, token: int | SamplingError, lp: TokenLogprob | None = None) -> None:
        if isinstance(token, SamplingError):
            self._fail(r, RequestFailed(f"generation failed: sampling: {token}"))
            return
        r.generated += 1
        r.last = token
        r.emitted.append(token)
        with self._cv:
            self._generation_tokens += 1
        if token in r.stops:
            finish = "stop"
        elif r.generated >= r.params.max_tokens or r.length + 1 >= self.max_context:
            finish = "length"                   # max_tokens, or prompt + output fills the context
        else:
            finish = None
        prompt = r.prompt_lps if r.generated == 1 else None      # the prompt's logprobs ride on the first token
        self._send(r, Token(token, finish, lp, prompt))
        if finish is not None:
            self._retire(r)

    def _send(self, r: Request, item) -> None:
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

    def _fail(self, r: Request, e: RequestFailed) -> None:
        self._send(r, e)
        with self._cv:
            self._failed += 1
        if r.slot >= 0:
            self._retire(r, failed=True)

    def _retire(self, r: Request, failed: bool = False) -> None:
        if r is self._prefilling:
            self._prefilling = None
        else:
            self._active.remove(r)
        if self._prefix is None:
            self.model.caches.release(r.slot)
        else:                           # its positions stay for a later prompt to reuse, unless a step failed
            self._prefix.release(r.slot, None if failed else r.held())
        r.slot = -1
        with self._cv:
            self._request_seconds += 0.2 * (time.monotonic() - r.submitted - self._request_seconds)


def table(logits: torch.Tensor, batch: list[Request]) -> LogprobTable | None:
    """The logprob table of a step's rows that asked (on the device, read later), or None where none did."""
    return LogprobTable.of(logits, [r.params.logprobs for r in batch])


def _stop_scheduler(state: dict) -> None:
    """The scheduler's stop for weakref.finalize (it must not hold the engine): what close() does to the thread."""
    with state["_cv"]:
        state["_closed"] = True
        state["_cv"].notify()
    if state["_thread"] is not threading.current_thread():
        state["_thread"].join(timeout=10)

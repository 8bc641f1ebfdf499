"""LLM: the generation API the server builds on — many callers stream at once, one scheduler thread runs the model.

LLM.load builds the engine from an EngineConfig (or its keyword knobs); the scheduler it runs on (continuous
batching, chunked prefill, bounded queue, per-request failures) is engine.scheduler, and decode ahead is
engine.decode_ahead. What a request asks and gets back (SamplingParams, Token, RequestFailed, Overloaded) is
engine.request, exported here for callers.

Callers never touch the model. stream() hands a caller its tokens through a queue it iterates;
submit() calls the caller's own sink in the scheduler thread instead (the server's: straight into its
event loop, with no thread of its own per request). Closing a stream or cancelling a submitted request
frees its KV slot at the next turn.
"""
from __future__ import annotations

import queue
from collections.abc import Callable
from pathlib import Path

import torch

from engine.engine_config import EngineConfig
from engine.kernels.cpu import set_compute_threads
from engine.loader import load_model
from engine.tiers.ram import trim_heap
from engine.model_source import load_tokenizer, open_checkpoint
from engine.models.common import MoEModel
from engine.request import Overloaded, Request, RequestFailed, SamplingParams, Token
from engine.sampling import draw_seed
from engine.scheduler import Scheduler

__all__ = ["LLM", "Overloaded", "RequestFailed", "SamplingParams", "Stream", "Submitted", "Token"]


class Submitted:
    """A request handed to submit(): cancel() (any thread) ends it at the scheduler's next turn."""

    def __init__(self, llm: "LLM", req: Request):
        self._llm, self._req = llm, req

    def cancel(self, wake: bool = True) -> None:
        """wake=False (from a finalizer, which must not take a lock): the scheduler sees it at its next turn."""
        self._req.cancelled = True
        if wake:
            self._llm._wake()


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


class LLM(Scheduler):
    """The engine over a loaded model: callers' requests go to the scheduler (engine.scheduler), whose state and
    thread it is."""

    def __init__(self, model: MoEModel, tokenizer, model_dir: str | Path | None = None,
                 config: EngineConfig | None = None):
        """config: the scheduler's knobs (chunk_size, max_queue, decode_ahead); the rest were the load's."""
        self.tokenizer = tokenizer
        self.model_dir = Path(model_dir) if model_dir else None
        self.model_type: str = model.cfg.arch
        self.eos_token_ids: set[int] = set(model.cfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        super().__init__(model, config or EngineConfig())

    @classmethod
    def load(cls, model_dir, store_dir=None, config: EngineConfig | None = None, **knobs) -> "LLM":
        """The engine as `config` (or keyword knobs: EngineConfig's fields) says. config.threads: CPU compute
        threads (engine.kernels.cpu.set_compute_threads; None: its default), which the scheduler thread takes up
        when it starts. The loading runs on one torch thread so the calling thread keeps no OpenMP team of its
        own: with a second team alive, libgomp throttles its spin-waits and every parallel region of the
        decode pays a futex wake-up (measured: 19 → 14 tok/s on SmolLM2, 2 cores)."""

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
        return cls(model, tokenizer, model_dir, config)

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
        req = Request(prompt, params, stops, draw_seed(params.seed), sink)
        self._enqueue(req)
        return Submitted(self, req)

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> list[Token]:
        return list(self.stream(prompt_ids, params))

    def counters(self) -> dict:
        out = dict(self.model.provider.counters())
        if self.model.bench_routing is not None:      # benchmarking only: the routers' choice is drawn
            out["bench_routing"] = self.model.bench_routing.describe()
        if (graphs := self.model.graphs) is not None:
            out.update(decode_graph_replays=graphs.replays, decode_graph_captures=graphs.captures)
            if (sampler := getattr(graphs, "sampler", None)) is not None:    # engine.gpu.sampler_graph
                out.update(decode_sampler_graph_replays=sampler.replays)
        out.update(self._scheduler_counters())
        return out

    def close(self) -> None:
        self._stop()
        self.model.provider.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""The engine behind the server as it loads: the LLM once loaded, or why there is none yet (loading, failed,
draining), which /health reports and every other endpoint checks first (Engine.require)."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from engine.server import chat
from engine.server.detok import hidden_token_ids
from engine.server.errors import ApiError


class Engine:
    """The loaded LLM, or why there is none yet."""

    def __init__(self, llm=None, loader: Callable[[], Any] | None = None):
        assert (llm is None) != (loader is None), "give an llm or a loader"
        self.llm = llm
        self.loader = loader
        self.status = "ready" if llm is not None else "loading"
        self.error: str | None = None
        self.load_seconds = 0.0
        self.closed = False
        self.draining = False
        self.hidden: frozenset[int] = frozenset()
        self.end_of_turn: tuple[int, ...] = ()
        if llm is not None:
            self._prepare()

    def _prepare(self):
        self.hidden = hidden_token_ids(self.llm.tokenizer)
        self.end_of_turn = chat.end_of_turn_ids(self.llm.tokenizer)

    def start_loading(self, on_done: Callable[[], None]):
        def load():
            t0 = time.perf_counter()
            try:
                llm = self.loader()
            except BaseException as e:  # any failure is reported by /health, never a dead thread
                self.error = str(e) or type(e).__name__
                self.status = "failed"
                return
            self.load_seconds = time.perf_counter() - t0
            if self.closed:             # shut down while loading
                llm.close()
                return
            self.llm = llm
            self._prepare()
            self.status = "ready"
            on_done()
        threading.Thread(target=load, daemon=True, name="kiln-load").start()

    def require(self):
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        if self.status == "loading":
            raise ApiError(503, "the model is still loading", type="service_unavailable", code="loading")
        if self.status == "failed":
            raise ApiError(500, f"the model failed to load: {self.error}", type="server_error", code="load_failed")
        return self.llm

    def drain(self, message: str = "the server is shutting down"):
        """Refuse new requests (503) and end every running one with `message` (an error event, then [DONE])."""
        self.draining = True
        if self.llm is not None:
            self.llm.abort(message)

    def close(self):
        """Close what this app loaded; an llm handed in belongs to the caller."""
        self.closed = True
        if self.loader is not None and self.llm is not None:
            self.llm.close()

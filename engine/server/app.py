"""The OpenAI-compatible HTTP API over an LLM (engine.llm's interface), as a FastAPI app.

    create_app(llm)                 serve an engine already loaded (the caller closes it)
    create_app(loader=callable)     listen at once; `loader()` builds the engine in a thread;
                                    /health answers 503 until it returns, 500 if it raised

Here the app is put together from its parts, one job each: the load state (engine.server.load_state), the
endpoints over one ServerState (engine.server.endpoints; SSE in engine.server.streaming), the error handlers
(engine.server.errors) and three middlewares (engine.server.middleware). The loader callable is the seam the
CLI uses (LLM.load with its flags) and tests use to watch the loading state. Every error body has OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: validation errors, HTTP errors, a full queue (429 + Retry-After),
an oversized body (413, refused before it is read) and anything unexpected (500, its traceback logged with the
request's id, which every response carries as X-Request-Id).
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI

from engine.server.endpoints import ServerState, router
from engine.server.errors import install_handlers
from engine.server.load_state import Engine
from engine.server.metrics import Metrics
from engine.server.middleware import MAX_BODY_BYTES, ApiKeyMiddleware, BodyLimit, RequestContext


def create_app(llm=None, *, loader: Callable[[], Any] | None = None, served_name: str = "kiln",
               api_key: str | None = None, fingerprint: str | None = None,
               defaults: dict | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    engine = Engine(llm, loader)
    metrics = Metrics(lambda: engine.llm.counters() if engine.status == "ready" else None)

    def on_loaded():
        metrics.load_state.ready, metrics.load_state.seconds = 1, engine.load_seconds

    if llm is not None:
        on_loaded()

    @asynccontextmanager
    async def lifespan(app):
        if engine.status == "loading":
            engine.start_loading(on_loaded)
        yield
        engine.close()

    app = FastAPI(title="Kiln engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(engine, metrics, served_name, fingerprint,
                                   defaults or {"temperature": 1.0, "top_p": 1.0})
    app.state.engine = engine
    app.state.metrics = metrics
    install_handlers(app)
    app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)   # before the body is read
    app.add_middleware(RequestContext)                           # outermost: ids and the catch-all
    return app

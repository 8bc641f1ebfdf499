"""The OpenAI-compatible HTTP API over an LLM (engine.llm's interface), as a FastAPI app.

    create_app(llm)                 serve an engine already loaded (the caller closes it)
    create_app(loader=callable)     listen at once; `loader()` builds the engine in a thread;
                                    /health answers 503 until it returns, 500 if it raised

The loader callable is the seam the CLI uses (LLM.load with its flags) and tests use to
watch the loading state. Every error body has OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from pathlib import Path
import re
import threading
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.llm import SamplingParams
from engine.server import chat
from engine.server.detok import hidden_token_ids
from engine.server.generation import Outcome, generate_text
from engine.server.metrics import CONTENT_TYPE, Metrics
from engine.server.parsers import OutputParser, assemble, string_params_of
from engine.server.schemas import ChatRequest, CompletionRequest, TokenizeRequest

_UNION_TAG = re.compile(r"\[|^(str|int|float|bool|dict|list|none)$")
OPEN_PATHS = ("/health", "/metrics")    # answered without the API key (probes, scrapers)


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status, message, type="invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}},
                        status_code=status)


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
        if self.status == "loading":
            raise ApiError(503, "the model is still loading", type="service_unavailable", code="loading")
        if self.status == "failed":
            raise ApiError(500, f"the model failed to load: {self.error}", type="server_error", code="load_failed")
        return self.llm

    def close(self):
        """Close what this app loaded; an llm handed in belongs to the caller."""
        self.closed = True
        if self.loader is not None and self.llm is not None:
            self.llm.close()


def sampling_defaults(model_dir, temperature: float | None = None, top_p: float | None = None) -> dict:
    """Defaults for requests that name no temperature/top_p: the flags, else the model's
    generation_config.json (as vLLM does), else OpenAI's 1.0."""
    gen = {}
    if model_dir is not None:
        try:
            gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
        except (OSError, ValueError):
            gen = {}
    pick = lambda flag, key: flag if flag is not None else (gen.get(key) if isinstance(gen.get(key), (int, float)) else 1.0)  # noqa: E731
    return {"temperature": float(pick(temperature, "temperature")), "top_p": float(pick(top_p, "top_p"))}


def create_app(llm=None, *, loader: Callable[[], Any] | None = None, served_name: str = "kiln",
               api_key: str | None = None, fingerprint: str | None = None,
               defaults: dict | None = None) -> FastAPI:
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
    app.state.engine = engine
    app.state.metrics = metrics

    def system_fingerprint() -> str:
        base = fingerprint or f"{engine.llm.model_type}|{engine.llm.max_context}"
        return "kiln-" + hashlib.sha256(f"{served_name}|{base}".encode()).hexdigest()[:12]

    # ---- errors, all in OpenAI's shape -------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        # drop "body" and pydantic's union-branch tags ("str", "list[int]", "function-after[…]")
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _UNION_TAG.search(str(x))]
        if err.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
        param = ".".join(loc) or None
        msg = err["msg"].removeprefix("Value error, ")
        return error_response(400, f"{param}: {msg}" if param else msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind)

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    def check_model(name: str | None):
        if name not in (None, served_name):
            raise ApiError(400, f"model {name!r} is not served here (this server serves {served_name!r})",
                           param="model", code="model_not_found")

    def check_length(llm, n: int, param: str):
        if n >= llm.max_context:
            raise ApiError(400, f"prompt is {n} tokens; the context is {llm.max_context} "
                                "(no room to generate)", param=param, code="context_length_exceeded")

    def sampling(llm, req, n_prompt: int, stop_ids: tuple[int, ...]):
        room = llm.max_context - n_prompt
        want = getattr(req, "max_completion_tokens", None) or req.max_tokens or room
        d = defaults or {"temperature": 1.0, "top_p": 1.0}
        return SamplingParams(max_tokens=min(want, room),
                              temperature=d["temperature"] if req.temperature is None else req.temperature,
                              top_p=d["top_p"] if req.top_p is None else req.top_p,
                              seed=req.seed, stop_token_ids=() if req.ignore_eos else stop_ids,
                              ignore_eos=req.ignore_eos)

    def start(llm, ids, params):
        """LLM.stream checks its input eagerly (length, ids, params): its refusal is the client's 400."""
        try:
            return llm.stream(ids, params)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None

    def usage(n_prompt: int, n_completion: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                "total_tokens": n_prompt + n_completion}

    # ---- endpoints -------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine.status == "ready":
            return {"status": "ready"}
        if engine.status == "loading":
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "failed", "error": engine.error}, status_code=500)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        llm = engine.require()
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "kiln", "max_model_len": llm.max_context}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        llm = engine.require()
        check_model(req.model)
        if req.messages is not None:
            _, ids = await run_in_threadpool(chat_prompt, llm, req.messages, req.tools, req.chat_template_kwargs,
                                             req.add_generation_prompt)
        else:
            ids = await run_in_threadpool(chat.encode, llm.tokenizer, req.prompt, req.add_special_tokens)
        return {"count": len(ids), "tokens": ids, "max_model_len": llm.max_context}

    def chat_prompt(llm, messages, tools, template_kwargs, add_generation_prompt=True) -> tuple[str, list[int]]:
        """(prompt text, ids). Runs in a worker thread: a long prompt takes a while to render and tokenize."""
        try:
            text = chat.render(llm.tokenizer, [m.model_dump(exclude_none=False) for m in messages],
                               [t.model_dump(exclude_none=True) for t in tools] if tools else None,
                               template_kwargs, add_generation_prompt)
        except chat.ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        return text, chat.encode(llm.tokenizer, text, add_special_tokens=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        t0 = time.perf_counter()
        llm = engine.require()
        check_model(req.model)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt, ids = await run_in_threadpool(chat_prompt, llm, req.messages, req.tools, req.chat_template_kwargs)
        check_length(llm, len(ids), "messages")
        params = sampling(llm, req, len(ids), engine.end_of_turn)
        parser = OutputParser(think_opened=chat.think_opened(prompt),
                              tools=bool(tools) and req.tool_choice != "none",
                              string_params=string_params_of(tools))
        outcome = Outcome(started=t0)
        text = generate_text(start(llm, ids, params), llm.tokenizer, stops=req.stop, hidden=engine.hidden,
                             metrics=metrics, endpoint="chat", outcome=outcome)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served_name,
                "system_fingerprint": system_fingerprint()}

        def finish_reason(saw_call: bool) -> str:
            return "tool_calls" if saw_call and outcome.finish_reason == "stop" else outcome.finish_reason

        if not req.stream:
            pieces = []
            async with aclosing(text):
                async for chunk in text:
                    pieces.extend(parser.feed(chunk))
                    if await request.is_disconnected():
                        return Response(status_code=499)   # nobody to answer: stop generating
            pieces.extend(parser.finish())
            msg = assemble(pieces)
            message = {"role": "assistant", "content": msg.content, "reasoning_content": msg.reasoning}
            if msg.tool_calls:
                message["tool_calls"] = [c.openai() for c in msg.tool_calls]
            metrics.request_seconds.labels("chat").observe(time.perf_counter() - t0)
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "logprobs": None,
                                 "finish_reason": finish_reason(bool(msg.tool_calls))}],
                    "usage": usage(len(ids), outcome.completion_tokens)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict, finish: str | None = None) -> str:
            body = {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                body["usage"] = None
            return sse(body)

        async def events():
            calls = 0
            try:
                yield chunk({"role": "assistant", "content": ""})
                async with aclosing(text):
                    async for piece_text in text:
                        for p in parser.feed(piece_text):
                            yield chunk(delta_of(p, calls))
                            calls += p.kind == "tool_call"
                for p in parser.finish():
                    yield chunk(delta_of(p, calls))
                    calls += p.kind == "tool_call"
                yield chunk({}, finish_reason(calls > 0))
                if include_usage:
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                               "usage": usage(len(ids), outcome.completion_tokens)})
            except Exception as e:      # after the headers: say so in the stream, then end it
                yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
            yield "data: [DONE]\n\n"
            metrics.request_seconds.labels("chat").observe(time.perf_counter() - t0)

        return EventStream(events())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        t0 = time.perf_counter()
        llm = engine.require()
        check_model(req.model)
        prompts = []
        for p in req.prompts():
            ids = await run_in_threadpool(chat.encode, llm.tokenizer, p, True) if isinstance(p, str) else p
            if not ids:
                raise ApiError(400, "the prompt is empty", param="prompt")
            check_length(llm, len(ids), "prompt")
            prompts.append(ids)
        if req.stream and len(prompts) > 1:
            raise ApiError(400, "streaming takes one prompt", param="prompt")
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served_name,
                "system_fingerprint": system_fingerprint()}
        runs = []                       # every prompt checked by the engine before any starts
        for ids in prompts:
            outcome = Outcome(started=t0)
            runs.append((outcome, generate_text(start(llm, ids, sampling(llm, req, len(ids), ())), llm.tokenizer,
                                                stops=req.stop, hidden=engine.hidden, metrics=metrics,
                                                endpoint="completions", outcome=outcome)))

        if not req.stream:
            async def collect(text):
                out = []
                async with aclosing(text):
                    async for chunk in text:
                        out.append(chunk)
                        if await request.is_disconnected():
                            break       # nobody to answer: stop generating
                return "".join(out)
            texts = await asyncio.gather(*(collect(text) for _, text in runs))
            metrics.request_seconds.labels("completions").observe(time.perf_counter() - t0)
            return {**head, "object": "text_completion",
                    "choices": [{"index": i, "text": out, "logprobs": None, "finish_reason": o.finish_reason}
                                for i, (out, (o, _)) in enumerate(zip(texts, runs))],
                    "usage": usage(sum(map(len, prompts)), sum(o.completion_tokens for o, _ in runs))}

        ids = prompts[0]
        outcome, text = runs[0]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(piece: str, finish: str | None = None) -> str:
            body = {**head, "object": "text_completion",
                    "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                body["usage"] = None
            return sse(body)

        async def events():
            try:
                async with aclosing(text):
                    async for piece in text:
                        yield chunk(piece)
                yield chunk("", outcome.finish_reason)
                if include_usage:
                    yield sse({**head, "object": "text_completion", "choices": [],
                               "usage": usage(len(ids), outcome.completion_tokens)})
            except Exception as e:
                yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
            yield "data: [DONE]\n\n"
            metrics.request_seconds.labels("completions").observe(time.perf_counter() - t0)

        return EventStream(events())

    return app


def delta_of(p, index: int) -> dict:
    if p.kind == "reasoning":
        return {"reasoning_content": p.text}
    if p.kind == "content":
        return {"content": p.text}
    return {"tool_calls": [{"index": index, **p.call.openai()}]}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer KEY`, before anything else is read (pure ASGI, so
    streamed responses and client disconnects pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                response = error_response(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                          type="authentication_error", code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)

"""The OpenAI-compatible HTTP API over an LLM (engine.llm's interface), as a FastAPI app.

    create_app(llm)                 serve an engine already loaded (the caller closes it)
    create_app(loader=callable)     listen at once; `loader()` builds the engine in a thread;
                                    /health answers 503 until it returns, 500 if it raised

The endpoints are module-level functions over one `ServerState` (app.state.server), so each can be
called and tested alone; chat and completions build their chunks and hand them to one SSE helper.
The loader callable is the seam the CLI uses (LLM.load with its flags) and tests use to watch the
loading state. Every error body has OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
the handlers below turn validation errors, HTTP errors, a full queue (429 + Retry-After), an
oversized body (413, refused before it is read) and anything unexpected (500, its traceback logged
with the request's id, which every response carries as X-Request-Id) into it.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import threading
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.llm import Overloaded, RequestFailed, SamplingParams
from engine.server import chat
from engine.server.detok import hidden_token_ids
from engine.server.generation import Outcome, TokenPump, generate_text
from engine.server.metrics import CONTENT_TYPE, Metrics
from engine.server.parsers import OutputParser, assemble, string_params_of
from engine.server.schemas import ChatRequest, CompletionRequest, FieldError, TokenizeRequest

log = logging.getLogger("engine.server")

_UNION_TAG = re.compile(r"\[|^(str|int|float|bool|dict|list|none)$")
OPEN_PATHS = ("/health", "/metrics")    # answered without the API key (probes, scrapers)
MAX_BODY_BYTES = 8 * 1024 * 1024        # engine serve --max-body-bytes: refused with 413 before it is read


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_response(status, message, type="invalid_request_error", param=None, code=None, headers=None) -> JSONResponse:
    return ApiError(status, message, type=type, param=param, code=code, headers=headers).response()


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


@dataclass
class ServerState:
    """Everything the endpoints share (app.state.server)."""

    engine: Engine
    metrics: Metrics
    served_name: str = "kiln"
    fingerprint: str | None = None
    defaults: dict = field(default_factory=lambda: {"temperature": 1.0, "top_p": 1.0})

    def system_fingerprint(self) -> str:
        base = self.fingerprint or f"{self.engine.llm.model_type}|{self.engine.llm.max_context}"
        return "kiln-" + hashlib.sha256(f"{self.served_name}|{base}".encode()).hexdigest()[:12]

    def check_model(self, name: str | None):
        if name not in (None, self.served_name):
            raise ApiError(400, f"model {name!r} is not served here (this server serves {self.served_name!r})",
                           param="model", code="model_not_found")

    def sampling(self, llm, req, n_prompt: int, stop_ids: tuple[int, ...]) -> SamplingParams:
        room = llm.max_context - n_prompt
        want = getattr(req, "max_completion_tokens", None) or req.max_tokens or room
        d = self.defaults
        return SamplingParams(max_tokens=min(want, room),
                              temperature=d["temperature"] if req.temperature is None else req.temperature,
                              top_p=d["top_p"] if req.top_p is None else req.top_p,
                              seed=req.seed, stop_token_ids=() if req.ignore_eos else stop_ids,
                              ignore_eos=req.ignore_eos, top_k=req.top_k, min_p=req.min_p,
                              repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty)

    def generation(self, llm, ids, params, req, endpoint: str, t0: float) -> tuple[Outcome, AsyncIterator[str]]:
        outcome = Outcome(started=t0)
        return outcome, generate_text(start(llm, ids, params), llm.tokenizer, stops=req.stop, hidden=self.engine.hidden,
                                      metrics=self.metrics, endpoint=endpoint, outcome=outcome)

    def head(self, prefix: str) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.served_name,
                "system_fingerprint": self.system_fingerprint()}


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


# ---- pieces the endpoints share ------------------------------------------------------------------

def state_of(request: Request) -> ServerState:
    return request.app.state.server


def serving(request: Request, model: str | None):
    """(state, llm) for a request naming `model`: 503 while loading or draining, 400 for another model."""
    s = state_of(request)
    llm = s.engine.require()
    s.check_model(model)
    return s, llm


def request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "-")


def check_length(llm, n: int, param: str):
    if n >= llm.max_context:
        raise ApiError(400, f"prompt is {n} tokens; the context is {llm.max_context} "
                            "(no room to generate)", param=param, code="context_length_exceeded")


def start(llm, ids, params):
    """Submit to the engine. It checks its input eagerly (length, ids, params): its refusal is the client's
    400; a full queue is 429 with Retry-After."""
    try:
        return TokenPump(llm, ids, params)
    except Overloaded as e:
        raise ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(e.retry_after)}) from None
    except ValueError as e:
        msg = str(e)
        param = next((f for f in ("temperature", "top_p", "seed", "max_tokens") if msg.startswith(f"{f} is")), "prompt")
        raise ApiError(400, msg, param=param) from None


def failure(e: BaseException, rid: str) -> ApiError:
    """An exception met while generating → the error the client sees (and the log line that names it)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestFailed):
        log.warning("request %s: %s", rid, e)
        status = 503 if e.code in ("shutting_down", "engine_closed") else 500
        return ApiError(status, str(e), type="server_error", code=e.code)
    log.error("request %s failed", rid, exc_info=e)
    return ApiError(500, f"internal error (request id {rid}); the server's log has the details",
                    type="server_error", code="internal_error")


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


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


def event_stream(s: ServerState, endpoint: str, t0: float, rid: str, chunks: AsyncIterator[dict]) -> "EventStream":
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
        s.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)
    return EventStream(events())


def chat_prompt(llm, messages, tools, template_kwargs, add_generation_prompt=True) -> tuple[str, list[int]]:
    """(prompt text, ids). Runs in a worker thread: a long prompt takes a while to render and tokenize."""
    try:
        return chat.encode_chat(llm.tokenizer, [m.model_dump(exclude_none=False) for m in messages],
                                [t.model_dump(exclude_none=True) for t in tools] if tools else None,
                                template_kwargs, add_generation_prompt)
    except chat.ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages") from None


def model_card(s: ServerState, llm) -> dict:
    return {"id": s.served_name, "object": "model", "created": int(time.time()), "owned_by": "kiln",
            "max_model_len": llm.max_context}


# ---- endpoints -----------------------------------------------------------------------------------

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    engine = state_of(request).engine
    if engine.status == "ready" and not engine.draining:
        return {"status": "ready"}
    if engine.status == "loading" or engine.draining:
        return JSONResponse({"status": "draining" if engine.draining else "loading"}, status_code=503)
    return JSONResponse({"status": "failed", "error": engine.error}, status_code=500)


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request):
    s = state_of(request)
    return {"object": "list", "data": [model_card(s, s.engine.require())]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    s = state_of(request)
    llm = s.engine.require()
    if model_id != s.served_name:
        raise ApiError(404, f"model {model_id!r} is not served here (this server serves {s.served_name!r})",
                       param="model", code="model_not_found")
    return model_card(s, llm)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    s, llm = serving(request, req.model)
    if req.messages is not None:
        _, ids = await run_in_threadpool(chat_prompt, llm, req.messages, req.tools, req.chat_template_kwargs,
                                         req.add_generation_prompt)
    else:
        ids = await run_in_threadpool(chat.encode, llm.tokenizer, req.prompt, req.add_special_tokens)
    return {"count": len(ids), "tokens": ids, "max_model_len": llm.max_context}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatRequest, request: Request):
    t0 = time.perf_counter()
    s, llm = serving(request, req.model)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    prompt, ids = await run_in_threadpool(chat_prompt, llm, req.messages, req.tools, req.chat_template_kwargs)
    check_length(llm, len(ids), "messages")
    outcome, text = s.generation(llm, ids, s.sampling(llm, req, len(ids), s.engine.end_of_turn), req, "chat", t0)
    parser = OutputParser(think_opened=chat.think_opened(prompt), tools=bool(tools) and req.tool_choice != "none",
                          string_params=string_params_of(tools))
    head = s.head("chatcmpl")

    def finish_reason(saw_call: bool) -> str:
        return "tool_calls" if saw_call and outcome.finish_reason == "stop" else outcome.finish_reason

    if not req.stream:
        pieces = []
        try:
            async with aclosing(text):
                async for piece in text:
                    pieces.extend(parser.feed(piece))
                    if await request.is_disconnected():
                        return Response(status_code=499)   # nobody to answer: stop generating
        except Exception as e:
            raise failure(e, request_id(request)) from None
        pieces.extend(parser.finish())
        msg = assemble(pieces)
        message = {"role": "assistant", "content": msg.content, "reasoning_content": msg.reasoning}
        if msg.tool_calls:
            message["tool_calls"] = [c.openai() for c in msg.tool_calls]
        s.metrics.request_seconds.labels("chat").observe(time.perf_counter() - t0)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": finish_reason(bool(msg.tool_calls))}],
                "usage": usage(len(ids), outcome.completion_tokens)}

    frame = Chunks(head, "chat.completion.chunk", bool(req.stream_options and req.stream_options.include_usage))

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return frame.chunk({"delta": delta, "logprobs": None, "finish_reason": finish})

    async def chunks():
        calls = 0
        yield chunk({"role": "assistant", "content": ""})
        async with aclosing(text):
            async for piece in text:
                for p in parser.feed(piece):
                    yield chunk(delta_of(p, calls))
                    calls += p.kind == "tool_call"
        for p in parser.finish():
            yield chunk(delta_of(p, calls))
            calls += p.kind == "tool_call"
        yield chunk({}, finish_reason(calls > 0))
        if frame.include_usage:
            yield frame.usage(usage(len(ids), outcome.completion_tokens))

    return event_stream(s, "chat", t0, request_id(request), chunks())


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    t0 = time.perf_counter()
    s, llm = serving(request, req.model)
    texts_or_ids = req.prompts()
    if len(texts_or_ids) > llm.max_batch:
        raise ApiError(400, f"prompt: {len(texts_or_ids)} prompts in one request; this server takes at most "
                            f"{llm.max_batch} (its batch size)", param="prompt")
    if req.stream and len(texts_or_ids) > 1:
        raise ApiError(400, "streaming takes one prompt", param="prompt")
    prompts = []
    for p in texts_or_ids:
        ids = await run_in_threadpool(chat.encode, llm.tokenizer, p, True) if isinstance(p, str) else p
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        check_length(llm, len(ids), "prompt")
        prompts.append(ids)
    runs = []                           # every prompt submitted before any is read; a refusal ends them all
    try:
        for ids in prompts:
            runs.append(s.generation(llm, ids, s.sampling(llm, req, len(ids), ()), req, "completions", t0))
    except BaseException:
        for _, text in runs:
            await text.aclose()
        raise
    head = s.head("cmpl")

    if not req.stream:
        async def collect(text):
            out = []
            async with aclosing(text):
                async for piece in text:
                    out.append(piece)
                    if await request.is_disconnected():
                        break           # nobody to answer: stop generating
            return "".join(out)
        try:
            texts = await asyncio.gather(*(collect(text) for _, text in runs))
        except Exception as e:
            raise failure(e, request_id(request)) from None
        s.metrics.request_seconds.labels("completions").observe(time.perf_counter() - t0)
        return {**head, "object": "text_completion",
                "choices": [{"index": i, "text": out, "logprobs": None, "finish_reason": o.finish_reason}
                            for i, (out, (o, _)) in enumerate(zip(texts, runs))],
                "usage": usage(sum(map(len, prompts)), sum(o.completion_tokens for o, _ in runs))}

    (outcome, text), n_prompt = runs[0], len(prompts[0])
    frame = Chunks(head, "text_completion", bool(req.stream_options and req.stream_options.include_usage))

    def chunk(piece: str, finish: str | None = None) -> dict:
        return frame.chunk({"text": piece, "logprobs": None, "finish_reason": finish})

    async def chunks():
        async with aclosing(text):
            async for piece in text:
                yield chunk(piece)
        yield chunk("", outcome.finish_reason)
        if frame.include_usage:
            yield frame.usage(usage(n_prompt, outcome.completion_tokens))

    return event_stream(s, "completions", t0, request_id(request), chunks())


def delta_of(p, index: int) -> dict:
    if p.kind == "reasoning":
        return {"reasoning_content": p.text}
    if p.kind == "content":
        return {"content": p.text}
    return {"tool_calls": [{"index": index, **p.call.openai()}]}


# ---- errors, all in OpenAI's shape ---------------------------------------------------------------

async def _api_error(request, e: ApiError):
    return e.response()


async def _invalid(request, e: RequestValidationError):
    err = e.errors()[0]
    if err.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if (err.get("loc") == ("body",) and err.get("type") in ("model_attributes_type", "dict_type")
            and "json" not in request.headers.get("content-type", "")):
        got = request.headers.get("content-type")
        return error_response(415, f"the body must be JSON sent with Content-Type: application/json "
                                   f"({f'got {got!r}' if got else 'the request has no Content-Type'})",
                              code="unsupported_media_type")
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, FieldError):   # found by a whole-body check: it names its own field
        return error_response(400, f"{cause.path}: {cause.reason}", param=cause.path)
    # drop "body" and pydantic's union-branch tags ("str", "list[int]", "function-after[…]")
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _UNION_TAG.search(str(x))]
    param = ".".join(loc) or None
    msg = err["msg"].removeprefix("Value error, ")
    return error_response(400, f"{param}: {msg}" if param else msg, param=param)


async def _http(request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind)


class RequestContext:
    """Outermost (pure ASGI): gives each request an id (X-Request-Id, the client's if it sent a sane one),
    and turns anything that escapes the app into a 500 JSON error naming that id, with the traceback
    in the server's log under the same id."""

    _SANE = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        rid = given.decode() if self._SANE.match(given) else uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s: %s %s failed", rid, scope.get("method"), scope.get("path"))
            if not started:
                await error_response(500, f"internal error (request id {rid}); the server's log has the details",
                                     type="server_error", code="internal_error")(scope, receive, send_with_id)


class BodyLimit:
    """413 for a body over max_bytes, before the app reads (parses, tokenizes) any of it: at once from
    Content-Length, else as soon as the streamed body passes the limit."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max = app, max_bytes

    def _refusal(self, size: str):
        return error_response(413, f"the request body is {size}; this server takes at most {self.max} bytes "
                                   "(engine serve --max-body-bytes)", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max):
            return await self._refusal(f"{int(length)} bytes" if length.isdigit() else "of an unreadable length")(
                scope, receive, send)
        seen, refused = 0, False

        async def counted():
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max and not refused:
                    refused = True
                    await self._refusal(f"over {self.max} bytes")(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not refused:             # the app's own answer to a body we cut off goes nowhere
                await send(message)

        await self.app(scope, counted, guarded_send)


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
    """401 unless exactly one `Authorization: Bearer KEY`, before anything else is read (pure ASGI, so
    streamed responses and client disconnects pass through untouched). Two Authorization headers are
    refused whatever they hold: proxies and servers disagree on which one counts."""

    def __init__(self, app, api_key: str):
        assert api_key, "an empty API key would let everyone in"
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            token = given[0][7:] if len(given) == 1 and given[0][:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                why = ("send one Authorization header, not several" if len(given) > 1
                       else "invalid or missing API key (send Authorization: Bearer KEY)")
                response = error_response(401, why, type="authentication_error", code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


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
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)   # before the body is read
    app.add_middleware(RequestContext)                           # outermost: ids and the catch-all
    return app

"""The API's endpoints, as module-level functions over one ServerState (app.state.server), so each can be called and
tested alone; chat and completions build their chunks and hand them to one SSE helper (engine.server.streaming)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engine.request import Overloaded, SamplingParams
from engine.server import chat
from engine.server.errors import ApiError, failure
from engine.server.generation import Outcome, TokenPump, generate_text
from engine.server.load_state import Engine
from engine.server.logprobs import CompletionLogprobs, chat_logprobs, token_text
from engine.server.metrics import CONTENT_TYPE, Metrics
from engine.server.parsers import OutputParser, assemble, string_params_of
from engine.server.schemas import ChatRequest, CompletionRequest, TokenizeRequest
from engine.server.streaming import Chunks, event_stream


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

    def sampling(self, llm, req, n_prompt: int, stop_ids: tuple[int, ...], logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's params for `req`; max_tokens 0 (completions' echo alone) asks the engine for one token,
        which the answer drops (generation(show=False))."""
        room = llm.max_context - n_prompt
        want = 1 if req.max_tokens == 0 else getattr(req, "max_completion_tokens", None) or req.max_tokens or room
        d = self.defaults
        return SamplingParams(max_tokens=min(want, room), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              temperature=d["temperature"] if req.temperature is None else req.temperature,
                              top_p=d["top_p"] if req.top_p is None else req.top_p,
                              seed=req.seed, stop_token_ids=() if req.ignore_eos else stop_ids,
                              ignore_eos=req.ignore_eos, top_k=req.top_k, min_p=req.min_p,
                              repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty)

    def generation(self, llm, ids, params, req, endpoint: str, t0: float) -> tuple[Outcome, AsyncIterator[str]]:
        outcome = Outcome(started=t0)
        return outcome, generate_text(start(llm, ids, params), llm.tokenizer, stops=req.stop, hidden=self.engine.hidden,
                                      metrics=self.metrics, endpoint=endpoint, outcome=outcome,
                                      show=req.max_tokens != 0)

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


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


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
    asked = (req.top_logprobs or 0) if req.logprobs else None
    outcome, text = s.generation(llm, ids, s.sampling(llm, req, len(ids), s.engine.end_of_turn, asked), req, "chat", t0)
    vocab = token_text(llm.tokenizer) if asked is not None else None
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
                "choices": [{"index": 0, "message": message,
                             "logprobs": chat_logprobs(vocab, outcome.logprobs) if vocab else None,
                             "finish_reason": finish_reason(bool(msg.tool_calls))}],
                "usage": usage(len(ids), outcome.completion_tokens)}

    frame = Chunks(head, "chat.completion.chunk", bool(req.stream_options and req.stream_options.include_usage))

    sent = 0                            # outcome.logprobs' entries already in a chunk

    def chunk(delta: dict, finish: str | None = None) -> dict:
        nonlocal sent
        lps = None
        if vocab is not None and len(outcome.logprobs) > sent:
            lps, sent = chat_logprobs(vocab, outcome.logprobs[sent:]), len(outcome.logprobs)
        return frame.chunk({"delta": delta, "logprobs": lps, "finish_reason": finish})

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

    return event_stream(s.metrics, "chat", t0, request_id(request), chunks())


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
    asked, echo = req.logprobs, req.echo
    try:
        for ids in prompts:
            params = s.sampling(llm, req, len(ids), (), asked, asked if echo else None)
            runs.append(s.generation(llm, ids, params, req, "completions", t0))
    except BaseException:
        for _, text in runs:
            await text.aclose()
        raise
    head = s.head("cmpl")
    vocab = token_text(llm.tokenizer) if asked is not None else None
    echoed = [(p if isinstance(p, str) else llm.tokenizer.decode(ids, skip_special_tokens=False,
                                                                  clean_up_tokenization_spaces=False)) if echo else ""
              for p, ids in zip(texts_or_ids, prompts)]

    def prompt_block(lp: CompletionLogprobs, i: int, outcome: Outcome) -> dict:
        """Prompt i's logprobs (its first token's null); the answer's offsets go on after its echoed text."""
        ids = prompts[i]
        block = lp.block(list(zip(ids, outcome.prompt_logprobs or [None] * len(ids))))
        lp.offset = len(echoed[i])
        return block

    def choice_logprobs(i: int, outcome: Outcome) -> dict | None:
        if vocab is None:
            return None
        lp = CompletionLogprobs(vocab)
        blocks = ([prompt_block(lp, i, outcome)] if echo else []) + [lp.block(outcome.logprobs)]
        return {k: [v for b in blocks for v in b[k]] for k in blocks[0]}

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
                "choices": [{"index": i, "text": echoed[i] + out, "logprobs": choice_logprobs(i, o),
                             "finish_reason": o.finish_reason} for i, (out, (o, _)) in enumerate(zip(texts, runs))],
                "usage": usage(sum(map(len, prompts)), sum(o.completion_tokens for o, _ in runs))}

    (outcome, text), n_prompt = runs[0], len(prompts[0])
    frame = Chunks(head, "text_completion", bool(req.stream_options and req.stream_options.include_usage))

    lp = CompletionLogprobs(vocab) if vocab is not None else None
    sent = 0                            # outcome.logprobs' entries already in a chunk

    def chunk(piece: str, finish: str | None = None) -> dict:
        nonlocal sent
        block = None
        if lp is not None and len(outcome.logprobs) > sent:
            block, sent = lp.block(outcome.logprobs[sent:]), len(outcome.logprobs)
        return frame.chunk({"text": piece, "logprobs": block, "finish_reason": finish})

    def echo_chunk() -> dict:           # the prompt, once its logprobs came with the first token
        return frame.chunk({"text": echoed[0], "logprobs": prompt_block(lp, 0, outcome) if lp else None,
                            "finish_reason": None})

    async def chunks():
        echo_due = echo
        async with aclosing(text):
            async for piece in text:
                if echo_due:
                    echo_due = False
                    yield echo_chunk()
                yield chunk(piece)
        if echo_due:
            yield echo_chunk()
        yield chunk("", outcome.finish_reason)
        if frame.include_usage:
            yield frame.usage(usage(n_prompt, outcome.completion_tokens))

    return event_stream(s.metrics, "completions", t0, request_id(request), chunks())


def delta_of(p, index: int) -> dict:
    if p.kind == "reasoning":
        return {"reasoning_content": p.text}
    if p.kind == "content":
        return {"content": p.text}
    return {"tool_calls": [{"index": index, **p.call.openai()}]}

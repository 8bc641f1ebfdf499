"""One OpenAI-compatible HTTP client for the gates: JSON calls, SSE streams, request records.

Every failure (refused connection, timeout, HTTP error, non-JSON body, malformed SSE, a stream
cut short) comes out as ClientError with a one-line reason, so a gate can fail with that reason
and the run can go on. Each exchange is summarised into `records` for the evidence file.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import requests
import urllib3

# Enough of a long prompt's text to recognise it in the evidence without storing 100k tokens.
_PREVIEW_CHARS = 160
# The most one read of a stream takes: what a socket holds at once, so one read is one arrival.
_READ_MAX = 1 << 16
# A read that returns sooner found its bytes already waiting: they arrived with the read before (a body written
# in one go is one piece however the transport cut it). A syscall on waiting data takes microseconds.
_WAITED_S = 0.0002


class ClientError(Exception):
    """A request that did not give a usable answer; str(e) is the one-line reason."""


def server_root(base_url: str) -> str:
    """The OpenAI base URL (…/v1) → the server root, where /tokenize and /health live."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def summarise_body(body: dict) -> dict:
    """A request body for the evidence: every field, but long message texts shortened and hashed."""
    out = {k: v for k, v in body.items() if k not in ("messages", "prompt")}
    if "messages" in body:
        msgs = []
        for m in body["messages"]:
            m = dict(m)
            text = m.get("content")
            if isinstance(text, str) and len(text) > 2 * _PREVIEW_CHARS:
                m["content"] = f"{text[:_PREVIEW_CHARS]} … {text[-_PREVIEW_CHARS:]}"
                m["content_chars"] = len(text)
                m["content_sha256"] = hashlib.sha256(text.encode()).hexdigest()
            msgs.append(m)
        out["messages"] = msgs
    if "prompt" in body:
        out["prompt"] = body["prompt"]
    return out


@dataclass
class Answer:
    """One assistant turn, from a plain or a streamed response."""
    content: str = ""
    reasoning: str = ""
    reasoning_field: str | None = None      # which field carried it: reasoning_content or reasoning
    tool_calls: list = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    system_fingerprint: str | None = None
    model: str | None = None
    # streaming only
    ttft_s: float | None = None              # request sent → first text (content or reasoning)
    t_first: float | None = None             # perf_counter of the first and last text chunk
    t_last: float | None = None
    finish_s: float | None = None            # request sent → the event carrying finish_reason
    chunks: int = 0                          # events that carried text
    pieces: int = 0                          # arrivals that carried text (tool.checks.client._sse_lines)
    largest_piece: int = 0                   # text events in the fullest arrival
    cut_at_deadline: bool = False
    _per_piece: dict = field(default_factory=dict, repr=False)

    def arrived(self, piece: int) -> None:
        """One more text event, which came in arrival `piece`."""
        self._per_piece[piece] = self._per_piece.get(piece, 0) + 1
        self.pieces, self.largest_piece = len(self._per_piece), max(self._per_piece.values())

    def timings_lost(self) -> str | None:
        """Why this stream's arrival times cannot time a decode, or None: when one arrival carried more than half
        of its text events, something (the server, a proxy) held them back, and the first-to-last span measures
        that hold, not the decode (a stream buffered to its end reads as a decode of thousands of tok/s)."""
        if self.chunks < 2 or 2 * self.largest_piece <= self.chunks:
            return None
        how = "all" if self.largest_piece == self.chunks else f"{self.largest_piece}"
        return (f"{how} of the stream's {self.chunks} text chunks arrived in one piece ({self.pieces} "
                f"piece{'s' if self.pieces > 1 else ''} in all): the server or a proxy held them back, so the "
                f"stream's timings say nothing about decode")

    def summary(self) -> dict:
        out = {"content": self.content, "finish_reason": self.finish_reason}
        if self.reasoning:
            out["reasoning_chars"] = len(self.reasoning)
            out["reasoning_field"] = self.reasoning_field
            out["reasoning"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        for k in ("usage", "system_fingerprint", "model", "ttft_s", "chunks", "pieces", "largest_piece"):
            v = getattr(self, k)
            if v:
                out[k] = v
        if self.cut_at_deadline:
            out["cut_at_deadline"] = True
        return out


def _message_answer(choice: dict, answer: Answer) -> None:
    msg = choice.get("message") or {}
    answer.content = msg.get("content") or ""
    for key in ("reasoning_content", "reasoning"):
        if msg.get(key):
            answer.reasoning, answer.reasoning_field = msg[key], key
            break
    answer.tool_calls = msg.get("tool_calls") or []
    answer.finish_reason = choice.get("finish_reason")


class Client:
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0):
        self.base = base_url.rstrip("/")
        self.root = server_root(self.base)
        self._http = requests.Session()
        # The endpoint is named exactly; no proxy or ~/.netrc credentials (which would replace the key) from the environment.
        self._http.trust_env = False
        if api_key:
            self._http.headers["Authorization"] = f"Bearer {api_key}"
        self._connect_s, self._timeout_s = connect_timeout_s, timeout_s
        self.records: list[dict] = []        # every exchange; gates take theirs by index

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def url(self, path: str) -> str:
        """'/models' → under the OpenAI base; '//tokenize' (leading '//') → under the server root."""
        return self.root + path[1:] if path.startswith("//") else self.base + path

    # -- plain JSON --------------------------------------------------------------------------
    def request_json(self, method: str, path: str, body: dict | None = None, *, record: bool = True,
                     timeout_s: float | None = None) -> dict:
        url = self.url(path)
        rec = {"method": method, "url": url}
        if body is not None:
            rec["request"] = summarise_body(body)
        t0 = time.perf_counter()
        try:
            read_s = self._timeout_s if timeout_s is None else timeout_s
            r = self._http.request(method, url, json=body, timeout=(self._connect_s, read_s))
            rec["status"] = r.status_code
            if r.status_code >= 400:
                raise ClientError(f"{method} {url}: HTTP {r.status_code}{_error_detail(r)}")
            try:
                data = r.json()
            except ValueError:
                raise ClientError(f"{method} {url}: the body is not JSON "
                                  f"({r.headers.get('content-type', 'no content-type')}: {_snippet(r.text)})") from None
            if not isinstance(data, dict):
                raise ClientError(f"{method} {url}: expected a JSON object, got {type(data).__name__}")
            return data
        except ClientError as e:
            rec["error"] = str(e)
            raise
        except requests.RequestException as e:
            rec["error"] = _transport_reason(method, url, e)
            raise ClientError(rec["error"]) from None
        finally:
            rec["elapsed_s"] = round(time.perf_counter() - t0, 4)
            if record:
                self.records.append(rec)

    def chat(self, body: dict, *, timeout_s: float | None = None) -> Answer:
        """A non-streamed chat completion → its first choice."""
        data = self.request_json("POST", "/chat/completions", body, timeout_s=timeout_s)
        try:
            answer = _parse_completion(data, "POST " + self.url("/chat/completions"))
        except ClientError as e:
            self.records[-1]["error"] = str(e)
            raise
        self.records[-1]["answer"] = answer.summary()
        return answer

    # -- streaming ---------------------------------------------------------------------------
    def stream_chat(self, body: dict, *, window_s: float | None = None, on_text=None) -> Answer:
        """A streamed chat completion. Stops reading `window_s` after the first text when given
        (answer.cut_at_deadline). on_text(answer) is called after each text chunk (progress)."""
        url = self.url("/chat/completions")
        body = {**body, "stream": True}
        rec = {"method": "POST", "url": url, "request": summarise_body(body)}
        answer = Answer()
        calls: dict[int, dict] = {}
        done = False
        t0 = time.perf_counter()
        try:
            with self._http.post(url, json=body, stream=True, timeout=(self._connect_s, self._timeout_s)) as r:
                rec["status"] = r.status_code
                if r.status_code >= 400:
                    raise ClientError(f"POST {url}: HTTP {r.status_code}{_error_detail(r)}")
                ctype = r.headers.get("content-type", "")
                if "text/event-stream" not in ctype:
                    raise ClientError(f"POST {url}: expected an event stream, got {ctype or 'no content-type'}: "
                                      f"{_snippet(r.text)}")
                for piece, now, line in _sse_lines(r):
                    if not line.startswith("data:"):
                        continue             # comments, event:, id:, blank separators
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    try:
                        event = json.loads(payload)
                    except ValueError:
                        raise ClientError(f"POST {url}: malformed SSE event (not JSON): {_snippet(payload)}") from None
                    if not isinstance(event, dict):
                        raise ClientError(f"POST {url}: malformed SSE event (not an object): {_snippet(payload)}")
                    if "error" in event:
                        raise ClientError(f"POST {url}: the server sent an error mid-stream: {_snippet(json.dumps(event['error']))}")
                    if event.get("usage"):
                        answer.usage = event["usage"]
                    answer.system_fingerprint = event.get("system_fingerprint") or answer.system_fingerprint
                    answer.model = event.get("model") or answer.model
                    for choice in event.get("choices") or []:
                        had_finish = answer.finish_reason is not None
                        got_text = _apply_delta(choice, answer, calls)
                        if answer.finish_reason is not None and not had_finish:
                            answer.finish_s = round(now - t0, 4)
                        if got_text:
                            answer.chunks += 1
                            answer.arrived(piece)
                            if answer.t_first is None:
                                answer.t_first, answer.ttft_s = now, round(now - t0, 4)
                            answer.t_last = now
                            if on_text:
                                on_text(answer)
                    if window_s is not None and answer.t_first is not None and now - answer.t_first >= window_s \
                            and answer.finish_reason is None:
                        answer.cut_at_deadline = True
                        break
            if not done and not answer.cut_at_deadline and answer.finish_reason is None:
                raise ClientError(f"POST {url}: the stream ended before a finish_reason or [DONE]")
        except ClientError as e:
            rec["error"] = str(e)
            raise
        except requests.RequestException as e:
            # After the response began, a broken connection is the stream cut short; before, unreachable.
            rec["error"] = _transport_reason("POST", url, e, streaming="status" in rec)
            raise ClientError(rec["error"]) from None
        finally:
            answer.tool_calls = [calls[i] for i in sorted(calls)]
            rec["elapsed_s"] = round(time.perf_counter() - t0, 4)
            rec["answer"] = answer.summary()
            self.records.append(rec)
        return answer


def _apply_delta(choice: dict, answer: Answer, calls: dict[int, dict]) -> bool:
    """Fold one streamed choice into the answer; True when it carried text."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta") or {}
    got = False
    if delta.get("content"):
        answer.content += delta["content"]
        got = True
    for key in ("reasoning_content", "reasoning"):
        if delta.get(key):
            answer.reasoning += delta[key]
            answer.reasoning_field = answer.reasoning_field or key
            got = True
            break
    for tc in delta.get("tool_calls") or []:
        slot = calls.setdefault(tc.get("index", len(calls)), {"id": None, "type": "function",
                                                              "function": {"name": "", "arguments": ""}})
        slot["id"] = tc.get("id") or slot["id"]
        fn = tc.get("function") or {}
        slot["function"]["name"] += fn.get("name") or ""
        slot["function"]["arguments"] += fn.get("arguments") or ""
        got = True
    if choice.get("finish_reason"):
        answer.finish_reason = choice["finish_reason"]
    return got


def _parse_completion(data: dict, where: str) -> Answer:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ClientError(f"{where}: the response has no choices: {_snippet(json.dumps(data))}")
    answer = Answer(usage=data.get("usage"), system_fingerprint=data.get("system_fingerprint"),
                    model=data.get("model"))
    _message_answer(choices[0], answer)
    return answer


def _snippet(text: str, n: int = 120) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n] + "…"


def _reads(r: requests.Response):
    """The body as it arrives, whatever its framing: each HTTP chunk of a chunked body; of a close-delimited
    (HTTP/1.0-style) or Content-Length body, what one read of the socket gives. (iter_content would read such a
    body to its end before handing over a byte.) urllib3's errors come out as requests' own, as from iter_content."""
    raw = r.raw
    if raw.chunked and raw.supports_chunked_reads():
        yield from r.iter_content(chunk_size=None)
        return
    try:
        while data := raw.read1(_READ_MAX, decode_content=True):
            yield data
    except urllib3.exceptions.ReadTimeoutError as e:
        raise requests.exceptions.ReadTimeout(e) from None
    except urllib3.exceptions.DecodeError as e:
        raise requests.exceptions.ContentDecodingError(e) from None
    except (urllib3.exceptions.ProtocolError, urllib3.exceptions.SSLError) as e:
        raise requests.exceptions.ConnectionError(e) from None


def _sse_lines(r: requests.Response):
    """(piece, arrived, line) for each line of the stream: `arrived` the perf_counter of the read that completed
    it; `piece` the arrival it came in, a read that found its bytes already waiting continuing the one before."""
    pending, piece = b"", 0
    reads = _reads(r)
    while True:
        asked = time.perf_counter()
        data = next(reads, None)
        arrived = time.perf_counter()
        if data is None:
            break
        if arrived - asked > _WAITED_S:
            piece += 1
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield piece, arrived, line.rstrip(b"\r").decode("utf-8", "replace")
    if pending:
        yield piece, time.perf_counter(), pending.rstrip(b"\r").decode("utf-8", "replace")


def _error_detail(r: requests.Response) -> str:
    try:
        data = r.json()
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = err.get("message") if isinstance(err, dict) else err
        return f": {_snippet(msg if isinstance(msg, str) else json.dumps(msg))}"
    except Exception:  # the detail is a courtesy; the status code is the reason
        try:
            return f": {_snippet(r.text)}" if r.text.strip() else ""
        except Exception:
            return ""


def _transport_reason(method: str, url: str, e: Exception, streaming: bool = False) -> str:
    if isinstance(e, requests.Timeout):        # before ConnectionError: ConnectTimeout is both
        return f"{method} {url}: timed out ({type(e).__name__})"
    if isinstance(e, requests.ConnectionError) and not streaming:
        return f"cannot reach {url}: {_snippet(str(e)) or 'connection refused'}"
    if isinstance(e, (requests.exceptions.ChunkedEncodingError, requests.ConnectionError)) and streaming:
        return f"POST {url}: the server closed the connection mid-stream ({_snippet(str(e))})"
    return f"{method} {url}: {type(e).__name__}: {_snippet(str(e)) or 'transport error'}"

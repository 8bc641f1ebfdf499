"""The server's three ASGI middlewares, outermost first: RequestContext (request ids, the catch-all 500),
ApiKeyMiddleware (401 before anything is read; /health and /metrics open) and BodyLimit (413 before the body is
read). Pure ASGI, so streamed responses and client disconnects pass through untouched."""
from __future__ import annotations

import hmac
import logging
import re
import uuid

from engine.server.errors import error_response

log = logging.getLogger("engine.server")

OPEN_PATHS = ("/health", "/metrics")    # answered without the API key (probes, scrapers)
MAX_BODY_BYTES = 8 * 1024 * 1024        # engine serve --max-body-bytes: refused with 413 before it is read


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

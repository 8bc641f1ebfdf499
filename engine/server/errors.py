"""The server's errors, all in OpenAI's shape {"error": {"message", "type", "param", "code"}}: ApiError, what an
exception met while generating becomes (failure), and the app's handlers for validation errors, HTTP errors and
ApiError itself (install_handlers)."""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.request import RequestFailed
from engine.server.schemas import FieldError

log = logging.getLogger("engine.server")

_UNION_TAG = re.compile(r"\[|^(str|int|float|bool|dict|list|none)$")


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


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)

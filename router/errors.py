"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Every failure the router reports, over plain HTTP or as an SSE error event, goes through `APIError`
so that OpenAI clients raise their typed exceptions (BadRequestError, AuthenticationError, ...) with
a readable message instead of failing to parse the body.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.contract import DispatchError
from router.request_id import HEADER, request_id_of

# OpenAI uses "invalid_request_error" for every 4xx it raises itself (401 and 404 included); 429 and
# 5xx get their own types so clients and dashboards can tell "fix the request" from "retry later".
_TYPE_BY_STATUS = {
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}

# Pydantic location parts that name a union member rather than a field ("prompt" -> "list[int]").
_TYPE_TAGS = frozenset(
    {
        "str",
        "int",
        "float",
        "bool",
        "list",
        "dict",
        "none",
        "function-after",
        "function-before",
        "function-wrap",
        "literal",
    }
)


class APIError(Exception):
    """An error the router reports to the client, already in OpenAI's vocabulary."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        # Retry-After takes whole seconds; round up so a client never retries before we asked.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    def sse_event(self) -> str:
        """The error as one SSE event, for failures after the 200 and the first bytes went out."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_dispatch_error(e: DispatchError) -> APIError:
    return APIError(e.status, e.message, code=e.code, retry_after_s=e.retry_after_s)


def _param_from_loc(loc: tuple[Any, ...]) -> str:
    """("messages", 0, "content") -> "messages[0].content"; union-member tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not isinstance(part, str) or part in _TYPE_TAGS or not part.isidentifier():
            break
        else:
            out += f".{part}" if out else part
    return out


def from_validation_error(e: ValidationError) -> APIError:
    """The first pydantic error, worded the way OpenAI words its own 400s."""
    err = e.errors(include_url=False)[0]
    param = _param_from_loc(tuple(err.get("loc", ())))
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    # A custom ValueError raised in a validator carries the "Value error, " prefix; drop it.
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind.endswith("_type") or kind in {"model_type", "model_attributes_type"}:
        return bad_request(f"Invalid type for '{param}': {msg}", param=param, code="invalid_type")
    return bad_request(f"Invalid value for '{param}': {msg}", param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Route every error FastAPI/Starlette raises on its own (404 path, 405, 500) to OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Never leak a traceback to clients; the server log (uvicorn) still records it.
        response = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
        # This handler runs outside every middleware, so the request id middleware cannot add its header.
        response.headers[HEADER] = request_id_of(request)
        return response

"""What stands before the routes: the API key, the body size limit, and OpenAI-shaped error bodies.

Every refusal is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status: a missing or wrong key (401, compared in constant time), a body over the limit (413), bad JSON
(nested too deep to parse included) or a field of the wrong type or range (400), an unknown route (404).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """A request refused with ``status`` and an OpenAI error body; a 400 that names its ``param`` has the
    code ``invalid_value`` unless another is given, as every refused field value has (it was null for
    some fields and ``invalid_value`` for others)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        if code is None and status == 400 and param is not None:
            code = "invalid_value"
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = {"Retry-After": "1"} if status == 429 else {}  # a queue frees in about a reply's time


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


NOT_JSON = "the request body is not valid JSON"
TOO_DEEP = "the request body is JSON nested too deep to read"


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str | None:
    """The dotted field name of a validation error's location (``messages.0.role``), without ``body`` and
    the tags pydantic adds for the member of a union (``str``, ``list[int]``, ``TextPart``)."""
    parts = [
        str(p)
        for p in loc
        if p != "body" and not (isinstance(p, str) and (p in TYPE_TAGS or "[" in p or p[:1].isupper()))
    ]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI error bodies for refused requests, validation errors, HTTP errors and anything unforeseen."""

    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, NOT_JSON, None, "invalid_json")
        param = _param(tuple(first.get("loc", ())))
        message = (
            f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid body")
        )
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 400 and isinstance(e.__cause__, (ValueError, RecursionError)):
            # FastAPI's parse of a route's body failed other than by a JSONDecodeError (nested too deep)
            message = TOO_DEEP if isinstance(e.__cause__, RecursionError) else NOT_JSON
            return error_response(400, message, None, "invalid_json")
        return error_response(e.status_code, str(e.detail), headers=e.headers)  # a 405's Allow

    @app.exception_handler(Exception)
    async def _unforeseen(request: Request, e: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(e).__name__}")


PUBLIC = ("/health", "/", "/page/")


def _public(path: str) -> bool:
    return path in PUBLIC[:2] or path.startswith(PUBLIC[2])


class Guard:
    """ASGI middleware: the API key on every route but /health and the chat page's files, and a body limit.

    The body is read whole before the route runs (up to ``max_body`` bytes), so an oversized one is
    refused with 413 however it is sent (with a Content-Length or chunked).
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app, self.max_body = app, max_body
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key is not None and not _public(scope["path"]):
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(b" "), self.key):
                return await _send_error(send, 401, "invalid or missing API key (Authorization: Bearer KEY)")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _send_error(send, 413, f"request body over {self.max_body} bytes")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            more = message.get("more_body", False)
            if size > self.max_body:
                return await _send_error(send, 413, f"request body over {self.max_body} bytes")
        body = b"".join(parts)  # joined once: adding piece by piece copies a big body over and over
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_error(send: Send, status: int, message: str) -> None:
    payload = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})

"""The server's outer layer: what is refused before a route runs, and the shape of every error.

- **Body size.** A request body larger than `max_body_bytes` is answered 413 before it is read
  (by `Content-Length`, or while it streams in): a 10 MB prompt used to hold the server for 22 s
  of tokenizing before its 400. The default bound is `max(1 MiB, 64 bytes × the model's maximum
  length)`, far above any prompt the model can take.
- **Model name.** The OpenAI routes answer 404 for a `model` other than the served one (its
  name, or the path it was loaded from), as vLLM does; no `model` means the served one.
- **Every error is our JSON shape** `{"error": {"message", "type", "param", "code"}}`:
  Starlette's own errors (unknown route 404, wrong method 405, a body FastAPI cannot parse, e.g.
  an integer of more than 4,300 digits) included, never FastAPI's `{"detail": ...}`.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stream_rl.inference.context import ServerContext, api_error

MIN_BODY_BYTES = 1 << 20


def default_max_body_bytes(max_len: int) -> int:
    return max(MIN_BODY_BYTES, 64 * max_len)


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes, before the route reads it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counting() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counting, send)
        except _TooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = error_body(413, f"request body larger than {self.limit} bytes", "invalid_request_error")
        await JSONResponse(body, status_code=413)(scope, receive, send)


class _TooLarge(Exception):
    pass


async def starlette_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette/FastAPI HTTP errors in our shape (APIError has its own handler)."""
    assert isinstance(exc, StarletteHTTPException)
    message = str(exc.detail)
    if exc.status_code == 400 and "parsing the body" in message:
        message = "the body could not be parsed as JSON (an integer of more than 4300 digits?)"
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(exc.status_code, message, kind), exc.status_code, headers=exc.headers)


async def check_model(request: Request) -> None:
    """Router dependency of the OpenAI routes: 404 for a model this server does not serve."""
    ctx: ServerContext = request.app.state.ctx
    try:
        body = await request.json()  # cached by Starlette: the route parses it once more for free
    except (ValueError, UnicodeDecodeError):
        return  # the route's own validation answers 400
    model = body.get("model") if isinstance(body, dict) else None
    names = request.app.state.model_names
    if model is not None and model not in names:
        raise api_error(
            404,
            f"The model `{model}` does not exist (this server serves {ctx.model_name!r}).",
            "NotFoundError",
        )

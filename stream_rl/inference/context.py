"""State shared by the server's routes, and their error convention.

Every error response is JSON, OpenAI style: `{"error": {"message", "type", "param", "code"}}`
(raise `api_error(status, message)`); the app's handlers turn validation failures (bad JSON,
unknown fields, wrong types) into 400s of the same shape.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import HTTPException, Request
from pydantic import BaseModel, ValidationError

from stream_rl.inference.engine import Engine
from stream_rl.inference.metrics import ServerMetrics
from stream_rl.inference.model_maker import byte_symbols


class Receiver(Protocol):
    """What the server needs of `stream_rl.weights.receiver.WeightReceiver`."""

    ready: Any
    """After `receive`: a CUDA event the swap must wait for (None: the bytes are in place)."""

    def receive(self, metas: list[Any], bucket_bytes: int, into: Callable[[Any], Any]) -> float: ...

    def close(self) -> None: ...


ReceiverFactory = Callable[..., Receiver]
B = TypeVar("B", bound=BaseModel)


class APIError(HTTPException):
    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=body, headers=headers)
        self.body = body


def validation_message(errors: Sequence[Any]) -> str:
    """One line naming each invalid field (pydantic/FastAPI error dicts)."""
    parts = []
    for err in errors:
        if err.get("type") == "json_invalid":
            return "the body is not valid JSON"
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        msg = "unknown field" if err.get("type") == "extra_forbidden" else err.get("msg", "invalid")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts[:5]) or "invalid request"


def api_error(
    status: int, message: str, kind: str = "invalid_request_error", headers: dict[str, str] | None = None
) -> APIError:
    return APIError(
        status, {"error": {"message": message, "type": kind, "param": None, "code": status}}, headers
    )


class TokenPieces:
    """Each token id's text and bytes, cached (logprobs responses name every token)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(tokenizer.backend_tokenizer, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._byte_of = {symbol: b for b, symbol in enumerate(byte_symbols())}

    def get(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            text = self.tokenizer.decode([token])
            raw = list(text.encode("utf-8"))
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if self._byte_level and isinstance(piece, str) and all(c in self._byte_of for c in piece):
                raw = [self._byte_of[c] for c in piece]  # the token's true bytes
            hit = self._cache[token] = (text, raw)
        return hit


@dataclass
class ServerContext:
    engine: Engine
    model_name: str
    metrics: ServerMetrics
    receiver_factory: ReceiverFactory
    admin_token: str | None = None
    api_key: str | None = None
    """The key the OpenAI routes (`/v1/*`) require (None: open)."""
    weights_timeout_s: float = 60.0
    receiver: Receiver | None = None
    ipc_peer: str | None = None
    """The GPU uuid of a trainer that joined over CUDA IPC (`ipc_routes.py`)."""
    ipc_stream: Any = None
    """The CUDA stream CUDA IPC updates are copied on (created at the first init_ipc)."""
    weights_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pieces: TokenPieces = field(init=False)

    def __post_init__(self) -> None:
        self.pieces = TokenPieces(self.engine.tokenizer)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def admin_body(self, request: Request, model: type[B]) -> B:
        """Check the admin token, then parse the JSON body as `model` (400 when it does not fit)."""
        self.check_admin(request)
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            raise api_error(400, validation_message(exc.errors())) from exc

    def check_admin(self, request: Request) -> None:
        """401 unless the request carries `Authorization: Bearer <admin token>` (when one is set)."""
        check_bearer(request, self.admin_token, "admin token")

    def check_api_key(self, request: Request) -> None:
        """401 unless the request carries `Authorization: Bearer <API key>` (when one is set)."""
        check_bearer(request, self.api_key, "API key")


def check_bearer(request: Request, expected: str | None, what: str) -> None:
    """401 (OpenAI's error shape, `WWW-Authenticate: Bearer`) unless the request's
    `Authorization: Bearer <token>` equals `expected`, compared in constant time; None: open."""
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise api_error(
            401,
            f"missing or wrong {what} (Authorization: Bearer ...)",
            "authentication_error",
            headers={"WWW-Authenticate": "Bearer"},
        )

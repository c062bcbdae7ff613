"""`--middleware stream_rl.weights.vllm_guard.guard` for vLLM servers in a stream-rl run: the admin
token on vLLM's weight routes, and a lease on pauses.

vLLM registers its weight routes (`/pause`, `/resume`, `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`, `/update_weight_version`,
`/collective_rpc`, ...) with `VLLM_SERVER_DEV_MODE=1` and no authentication (its `--api-key`
covers `/v1` only). This middleware, loaded by vLLM's own `--middleware` option, adds:

- **Admin token.** With `$STREAM_RL_ADMIN_TOKEN` set, every admin route answers 401 (JSON
  error) unless the request carries `Authorization: Bearer <token>`, as the built-in server's
  `/weights/*` do. The routes the actor uses (`/health`, `/weight_info`, `/v1/...`,
  `/inference/v1/generate`) stay open.
- **Pause lease.** A trainer pauses the server around each install (`/pause` ... `/resume`). A
  trainer that dies in between would leave it paused forever: after a successful `/pause`, if no
  `/resume` arrives within `$STREAM_RL_PAUSE_LEASE_S` seconds (default 120), the middleware
  resumes generation itself and logs it. Nothing else is undone: with the `stream_rl_gloo`
  engine no weight is installed before `/finish_weight_update`, which also sets the label, so
  weights and labels always agree.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("vllm.stream_rl.guard")  # under "vllm": printed by its handler

TOKEN_ENV = "STREAM_RL_ADMIN_TOKEN"
LEASE_ENV = "STREAM_RL_PAUSE_LEASE_S"
DEFAULT_LEASE_S = 120.0
OPEN_PATHS = ("/health", "/ping", "/version", "/weight_info", "/metrics", "/v1/", "/inference/v1/", "/load")
"""Routes served without the admin token (prefixes)."""

_lease: dict[str, asyncio.TimerHandle] = {}


def _is_admin(path: str) -> bool:
    return not any(path == p or (p.endswith("/") and path.startswith(p)) for p in OPEN_PATHS)


def _authorized(headers: Any, token: str) -> bool:
    given = headers.get("authorization", "")
    return given.startswith("Bearer ") and hmac.compare_digest(given[len("Bearer ") :], token)


def _unauthorized(message: str) -> Any:
    from starlette.responses import Response

    body = {"error": {"message": message, "type": "authentication_error", "param": None, "code": 401}}
    return Response(json.dumps(body), status_code=401, media_type="application/json")


def lease_seconds() -> float:
    raw = os.environ.get(LEASE_ENV)
    try:
        return float(raw) if raw else DEFAULT_LEASE_S
    except ValueError:
        return DEFAULT_LEASE_S


async def _expire(app: Any, lease_s: float) -> None:
    _lease.pop("pause", None)
    engine = app.state.engine_client
    if await engine.is_paused():
        log.warning("no /resume within %.0f s of /pause (did the trainer die?): resuming generation", lease_s)
        await engine.resume_generation()


def _arm(app: Any) -> None:
    _disarm()
    lease_s = lease_seconds()
    loop = asyncio.get_running_loop()
    _lease["pause"] = loop.call_later(lease_s, lambda: loop.create_task(_expire(app, lease_s)))


def _disarm() -> None:
    handle = _lease.pop("pause", None)
    if handle is not None:
        handle.cancel()


async def guard(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    path = request.url.path
    token = os.environ.get(TOKEN_ENV)
    if token and _is_admin(path) and not _authorized(request.headers, token):
        return _unauthorized(f"{path} needs the admin token (Authorization: Bearer ...)")
    response = await call_next(request)
    if path == "/pause" and response.status_code == 200:
        _arm(request.app)
    elif path == "/resume":
        _disarm()
    return response

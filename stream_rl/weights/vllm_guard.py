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
  resumes generation itself and logs it.
- **Labels that never lie.** Decoding never resumes on weights its label does not describe. The
  `stream_rl_gloo` engine installs nothing before `/finish_weight_update` (which also sets the
  label), so there the lease only resumes. Any other engine (vLLM's `nccl`) reloads the model
  layer by layer between `/start_weight_update` and `/finish_weight_update`, so the middleware
  follows the update session (open after a successful start, closed by a successful finish or a
  failed `/update_weights`, which ends vLLM's session) and:
  - after a failed `/update_weights` (some layers may be loaded) labels the weights `INCOMPLETE`;
  - when the lease expires with a session open, finishes it under `INCOMPLETE` first, then
    resumes.
  Our clients refuse tokens labelled `INCOMPLETE` (`stream_rl.inference.vllm_client`) until the
  next finished update labels the weights with its version.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from stream_rl.contracts.core import INCOMPLETE

log = logging.getLogger("vllm.stream_rl.guard")  # under "vllm": printed by its handler

TOKEN_ENV = "STREAM_RL_ADMIN_TOKEN"
LEASE_ENV = "STREAM_RL_PAUSE_LEASE_S"
DEFAULT_LEASE_S = 120.0
OPEN_PATHS = ("/health", "/ping", "/version", "/weight_info", "/metrics", "/v1/", "/inference/v1/", "/load")
"""Routes served without the admin token (prefixes)."""

GLOO_BACKEND = "stream_rl_gloo"
"""The one weight-transfer backend that installs nothing before finish (`vllm_engine.py`)."""
DISCARDED = "the unfinished weight update was discarded; the old weights stay"
"""stream_rl_gloo's answer to `update_info` `{"discard": true}` (vLLM: a 500, ending the session)."""

_lease: dict[str, asyncio.TimerHandle] = {}
_session = {"open": False}
"""Whether a weight update session is open on this server (started, not yet finished)."""


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


def installs_before_finish(app: Any) -> bool:
    """Whether this server's weight-transfer backend changes the model before finish (any but
    `stream_rl_gloo`; unknown counts as yes)."""
    config = getattr(app.state.engine_client, "vllm_config", None)
    backend = getattr(getattr(config, "weight_transfer_config", None), "backend", None)
    return backend != GLOO_BACKEND


async def _label_incomplete(engine: Any, why: str) -> None:
    log.warning("%s: the weights are labelled %r until the next finished update", why, INCOMPLETE)
    await engine.update_weight_version(INCOMPLETE)


async def _expire(app: Any, lease_s: float) -> None:
    _lease.pop("pause", None)
    engine = app.state.engine_client
    if not await engine.is_paused():
        return
    log.warning("no /resume within %.0f s of /pause (did the trainer die?): resuming generation", lease_s)
    if _session["open"] and installs_before_finish(app):
        # The dead trainer's update may have reloaded some layers: finish the session under a
        # label our clients refuse before anything decodes on them.
        _session["open"] = False
        try:
            await engine.finish_weight_update(INCOMPLETE)
        except Exception as exc:  # noqa: BLE001 (logged; the label below is what matters)
            log.warning("closing the dead trainer's weight update failed: %s", exc)
        await _label_incomplete(engine, "a weight update was left unfinished")
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
    ok = response.status_code == 200
    if path == "/pause" and ok:
        _arm(request.app)
    elif path == "/resume":
        _disarm()
    elif path == "/start_weight_update" and ok:
        _session["open"] = True
    elif path == "/finish_weight_update" and ok:
        _session["open"] = False
    elif path == "/update_weights" and not ok and _session["open"]:
        _session["open"] = False  # vLLM's worker ends the session when an update fails
        if installs_before_finish(request.app):
            await _label_incomplete(request.app.state.engine_client, "a weight update failed part-way")
    return response

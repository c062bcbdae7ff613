"""A test-only fault switch for the built-in server's `/v1/*` routes (the nemesis harness,
`tests/e2e/nemesis.py`): off unless `$STREAM_RL_SERVER_FAULTS` names a file. While that file holds
`500`, every `/v1/*` call is answered HTTP 500; while it holds `hang`, every call is accepted and
never answered until the file says otherwise (then 500: the client has mostly given up by then);
anything else (or no file): served as usual. `/health`, `/metrics` and `/weights/*` are never
touched, so a faulty server still looks alive to its probes and still takes weight updates, as a
server whose engine misbehaves does. Each faulted call is counted in the file's `.count` sibling
(the evidence that the fault was met)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

FAULTS_ENV = "STREAM_RL_SERVER_FAULTS"


def _mode(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def install(app: FastAPI) -> None:
    """Add the switch to `app` if `$STREAM_RL_SERVER_FAULTS` is set (a no-op otherwise)."""
    name = os.environ.get(FAULTS_ENV)
    if not name:
        return
    switch = Path(name)
    counter = switch.with_name(switch.name + ".count")
    met = {"500": 0, "hang": 0}

    def count(mode: str) -> None:
        met[mode] += 1
        counter.write_text(f"500 {met['500']}\nhang {met['hang']}\n")

    @app.middleware("http")
    async def faults(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        mode = _mode(switch) if request.url.path.startswith("/v1/") else ""
        if mode == "hang":
            count("hang")
            while _mode(switch) == "hang":
                await asyncio.sleep(0.2)
            mode = "500"
        elif mode == "500":
            count("500")
        if mode == "500":
            body = {"error": {"message": "injected fault (STREAM_RL_SERVER_FAULTS)", "type": "server_error"}}
            return JSONResponse(body, status_code=500)
        return await call_next(request)

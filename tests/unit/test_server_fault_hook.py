"""The built-in server's test-only fault switch (`stream_rl/inference/fault_hook.py`, used by the
nemesis): off without `$STREAM_RL_SERVER_FAULTS`; with it, `/v1/*` answered 500 or held (`hang`)
while the file says so and counted, every other route untouched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from stream_rl.inference import fault_hook

pytestmark = pytest.mark.unit


def _app(monkeypatch: pytest.MonkeyPatch, switch: Path | None) -> FastAPI:
    if switch is None:
        monkeypatch.delenv(fault_hook.FAULTS_ENV, raising=False)
    else:
        monkeypatch.setenv(fault_hook.FAULTS_ENV, str(switch))
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    fault_hook.install(app)
    return app


async def _calls(app: FastAPI, switch: Path | None) -> list[int]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as client:
        codes = [
            (await client.post("/v1/completions")).status_code,
            (await client.get("/health")).status_code,
        ]
        if switch is not None:
            switch.write_text("hang")
            held = asyncio.create_task(client.post("/v1/completions"))
            await asyncio.sleep(0.3)
            codes.append(int(held.done()))  # 0: still held
            switch.write_text("")
            codes.append((await held).status_code)
            codes.append((await client.post("/v1/completions")).status_code)
        return codes


def test_without_the_variable_nothing_changes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "switch").write_text("500")
    assert asyncio.run(_calls(_app(monkeypatch, None), None)) == [200, 200]


def test_500_then_hang_then_healed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    switch = tmp_path / "switch"
    switch.write_text("500")
    codes = asyncio.run(_calls(_app(monkeypatch, switch), switch))
    # 500 on /v1, /health untouched; a held call not answered while `hang`, 500 once released; healed: 200.
    assert codes == [500, 200, 0, 500, 200]
    assert (tmp_path / "switch.count").read_text() == "500 1\nhang 1\n"

"""The built-in server's outer layer (guards.py): oversized bodies refused before they are read,
every error in our JSON shape (FastAPI's own included), an unknown model name answered 404."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from stream_rl.inference.engine import Engine
from stream_rl.inference.model_maker import make_model
from stream_rl.inference.testing import ServerThread

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model = make_model(tmp_path_factory.mktemp("guards") / "tiny", "tiny", seed=0)
    with ServerThread(Engine.load(model, max_batch=4, seed=0), model_name="tiny") as s:
        yield s


def _post(server: ServerThread, path: str, body: bytes) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30
    )


def test_a_huge_prompt_is_refused_before_it_is_read(server: ServerThread) -> None:
    started = time.monotonic()
    r = _post(server, "/v1/completions", b'{"prompt": "' + b"1+1=" * 2_500_000 + b'", "max_tokens": 1}')
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    assert time.monotonic() - started < 5  # was 22 s of tokenizing before a 400


def test_errors_are_always_our_json_shape(server: ServerThread) -> None:
    seed = b"9" * 5000
    r = _post(server, "/v1/completions", b'{"prompt": "1+1=", "seed": ' + seed + b"}")
    assert r.status_code == 400 and "detail" not in r.json() and r.json()["error"]["code"] == 400
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_an_unknown_model_is_404_the_served_one_is_answered(server: ServerThread) -> None:
    r = _post(server, "/v1/completions", b'{"model": "gpt-9", "prompt": "1+1=", "max_tokens": 1}')
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    r = _post(
        server, "/v1/chat/completions", b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}'
    )
    assert r.status_code == 404
    r = _post(server, "/v1/completions", b'{"model": "tiny", "prompt": "1+1=", "max_tokens": 1}')
    assert r.status_code == 200
    assert _post(server, "/v1/completions", b'{"prompt": "1+1=", "max_tokens": 1}').status_code == 200

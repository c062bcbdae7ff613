"""The OpenAI routes' API key (`inference.api_key`, `stream-rl serve --api-key`, $VLLM_API_KEY):
the real server over HTTP (in-process, `fakes.server_thread`) refuses `/v1/*` without it and
leaves `/health` and `/metrics` open; the clients the actor and the evaluator build send it; the
launcher makes one only for servers beyond loopback and hands it over in the environment only."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fakes.server_thread import ServerThread
from models import cached_model

from stream_rl.config import load_config
from stream_rl.config.inference import API_KEY_ENV
from stream_rl.errors import ConfigError, InferenceError
from stream_rl.inference.engine import Engine
from stream_rl.kafka.stage import StopFlag
from stream_rl.run.children import child_env, run_api_key
from stream_rl.run.launch import Launcher

pytestmark = pytest.mark.unit

KEY = "k3y-for-tests"
ADMIN = "admin-t0k"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(
        Engine.load(cached_model("tiny"), max_batch=2), api_key=KEY, admin_token=ADMIN
    ) as running:
        yield running


def _v1_routes(server: ServerThread) -> list[tuple[str, str]]:
    """Every (method, path) the app serves under /v1 (so a route added later is covered too)."""
    routes: list[tuple[str, str]] = []
    for route in server.app.routes:
        path = getattr(route, "path", "")
        if path.startswith("/v1"):
            routes.extend((method, path) for method in sorted(getattr(route, "methods", ())))
    return routes


def test_every_v1_route_refuses_a_missing_or_wrong_key_with_an_openai_error(server: ServerThread) -> None:
    routes = _v1_routes(server)
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/v1/models") in routes
    for method, path in routes:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": KEY},
            {"Authorization": f"Basic {KEY}"},
        ):
            r = httpx.request(method, f"{server.url}{path}", json=CHAT, headers=headers, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            error = r.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == 401
            assert "API key" in error["message"] and KEY not in r.text


def test_the_right_key_is_served(server: ServerThread) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(f"{server.url}/v1/models", headers=auth, timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "test-model"
    text = {"prompt": [1, 2, 3], "max_tokens": 2}  # token ids through /v1/completions
    done = httpx.post(f"{server.url}/v1/completions", json=text, headers=auth, timeout=60)
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["finish_reason"] in ("length", "stop")
    chat = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers=auth, timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_health_and_metrics_stay_open(server: ServerThread) -> None:
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200


def test_the_api_key_and_the_admin_token_are_distinct(server: ServerThread) -> None:
    with_key = httpx.get(
        f"{server.url}/weights/version", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert with_key.status_code == 401 and "admin token" in with_key.json()["error"]["message"]
    with_admin = httpx.get(
        f"{server.url}/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
    )
    assert with_admin.status_code == 401


def test_the_actors_and_evaluators_clients_send_the_configured_key(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stream_rl.stages.routing import inference_client_factory

    async def version(overrides: list[str]) -> int:
        client = inference_client_factory(
            load_config(None, [f"inference.servers=[{{url: {server.url}}}]", *overrides])
        )(server.url)
        try:
            return int(await client.version())
        finally:
            await client.aclose()

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(InferenceError, match="HTTP 401"):
        asyncio.run(version([]))
    monkeypatch.setenv("MY_SERVER_KEY", KEY)
    assert asyncio.run(version(["inference.api_key=${MY_SERVER_KEY}"])) == 0
    monkeypatch.setenv(API_KEY_ENV, KEY)  # what the launcher gives its children
    assert asyncio.run(version([])) == 0


def test_a_key_file_is_read_and_an_empty_or_literal_key_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n")
    secret = load_config(None, [f"inference.api_key=file:{key_file}"]).inference.api_key_secret()
    assert secret is not None and secret.get_secret_value() == KEY
    for value, message in (("''", "empty"), ("sk-literal", "never the key itself")):
        with pytest.raises(ConfigError, match=message) as caught:
            load_config(None, [f"inference.api_key={value}"])
        assert "inference.api_key" in str(caught.value) and "\n" not in str(caught.value)
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="empty key") as caught:
        load_config(None, [f"inference.api_key=file:{key_file}"]).inference.api_key_secret()
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="NOT_SET_ANYWHERE is not set"):
        load_config(None, ["inference.api_key=${NOT_SET_ANYWHERE}"]).inference.api_key_secret()


def _launcher(tmp_path: Path, overrides: list[str]) -> Launcher:

    launcher = Launcher(load_config(None, [f"runs_dir={tmp_path}", *overrides]), StopFlag())
    launcher.bootstrap = "127.0.0.1:1"
    return launcher


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_the_launcher_makes_no_key_for_loopback_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    launcher = _launcher(tmp_path, [f"inference.host={host}"])
    assert launcher.api_key is None
    assert API_KEY_ENV not in child_env(launcher.config, launcher.admin_token, launcher.api_key)


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_servers_beyond_loopback_get_a_fresh_key_in_the_environment_never_on_a_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setenv("STREAM_RL_CACHE", str(tmp_path / "cache"))  # vLLM's plugin path is made there
    overrides = ["inference.host=0.0.0.0", f"inference.engine={engine}"]
    launcher = _launcher(tmp_path, overrides)
    key = launcher.api_key
    assert key is not None and len(key) >= 32
    assert _launcher(tmp_path, overrides).api_key != key  # one per run
    launcher.plan()
    server = launcher.add_server(0)
    children = [*launcher.children, server]
    assert any(c.role == "server" for c in children) and any(c.role == "actor" for c in children)
    for child in children:
        assert not any(key in arg for arg in child.cmd), child.name
        assert key not in child.env.values()
        assert key not in (child.dir / "cmd.txt").read_text()
        assert key not in shlex.join(child.cmd)
    # Every child (servers, vLLM included, which reads $VLLM_API_KEY; the actor; the evaluator)
    # starts with it: supervision spawns each with child_env(config, admin_token, api_key).
    assert child_env(launcher.config, launcher.admin_token, key)[API_KEY_ENV] == key
    assert key not in (launcher.run_dir / "config.yaml").read_text()


def test_a_configured_key_wins_and_given_servers_get_none_generated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setenv("MY_SERVER_KEY", KEY)
    assert (
        run_api_key(load_config(None, ["inference.host=0.0.0.0", "inference.api_key=${MY_SERVER_KEY}"]))
        == KEY
    )
    given = load_config(None, ["inference.host=0.0.0.0", "inference.servers=[{url: http://10.0.0.5:8000}]"])
    assert run_api_key(given) is None  # servers started by the user carry the key they were given
    monkeypatch.setenv(API_KEY_ENV, "inherited")
    assert run_api_key(load_config(None, ["inference.host=0.0.0.0"])) == "inherited"


def test_serve_refuses_an_empty_key_in_one_line() -> None:
    import argparse

    from stream_rl.inference.server import add_serve_arguments, main_serve

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with pytest.raises(ConfigError, match="--api-key is empty"):
        main_serve(parser.parse_args(["--model", "nowhere", "--api-key", " "]))

"""Each engine's client maps that engine's answers into `Completion`, from recorded bodies
(tests/data/vllm-0.32/: captured from a vLLM 0.32 CPU server with the launcher's flags, after a
push labelled "4"); errors: 400 -> BadRequestError, other statuses and malformed 200s ->
InferenceError quoting the body; `health()` takes an empty 200. And the vLLM guard middleware."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from stream_rl.config import SamplingConfig
from stream_rl.contracts import VersionSpan
from stream_rl.errors import BadRequestError, InferenceError
from stream_rl.inference.builtin_client import BuiltinClient
from stream_rl.inference.clients import make_client
from stream_rl.inference.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    SpanBody,
    TokenLogprob,
    Usage,
)
from stream_rl.inference.vllm_client import VLLMClient, WeightVersionSpan, label_version, spans_from_labels

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm-0.32"
Handler = Callable[[httpx.Request], httpx.Response]


def client_for(cls: type[Any], handler: Handler) -> Any:
    return cls("http://vllm", http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def recorded(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def vllm_handler(calls: list[tuple[str, Any]], generate: Any = None) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        calls.append((request.url.path, body))
        if request.url.path == "/v1/chat/completions/render":
            return httpx.Response(200, json=recorded("chat_render.json"))
        if request.url.path == "/inference/v1/generate":
            return httpx.Response(200, json=generate if generate is not None else recorded("generate.json"))
        if request.url.path == "/health":
            return httpx.Response(200)  # vLLM: an empty body
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "4"})
        return httpx.Response(404, json={"detail": "Not Found"})

    return handle


def test_vllm_chat_goes_render_then_generate_and_maps_every_field() -> None:
    calls: list[tuple[str, Any]] = []
    client = client_for(VLLMClient, vllm_handler(calls))
    messages = [{"role": "user", "content": "12+3="}]

    async def main() -> Any:
        out = await client.complete_many(messages, SamplingConfig(max_tokens=6), n=2, seed=5)
        await client.health()
        return out, await client.version()

    completions, version = asyncio.run(main())
    assert [path for path, _ in calls] == [
        "/v1/chat/completions/render",
        "/inference/v1/generate",
        "/health",
        "/weight_info",
    ]
    render_body, generate_body = calls[0][1], calls[1][1]
    assert render_body["messages"] == messages and render_body["n"] == 2 and render_body["seed"] == 5
    assert render_body["logprobs"] is True and render_body["top_k"] == 0
    assert generate_body["output_mode"] == "text" and "request_id" not in generate_body
    assert generate_body["token_ids"] == recorded("chat_render.json")["token_ids"]
    choices = recorded("generate.json")["choices"]
    assert version == 4
    assert len(completions) == 2
    for c, raw in zip(completions, choices, strict=True):
        assert c.prompt_token_ids == recorded("chat_render.json")["token_ids"]
        assert c.token_ids == raw["token_ids"]
        assert c.logprobs == [e["logprob"] for e in raw["logprobs"]["content"]]
        assert c.version_spans == [VersionSpan(4, 0)]
        assert c.text == raw["text"] and c.finish_reason == raw["finish_reason"]


@pytest.mark.parametrize(
    ("spans", "length", "expected"),
    [
        ([("default", 0, 3)], 3, [VersionSpan(0, 0)]),
        ([("default", 0, 2), ("0", 2, 5), ("1", 5, 7)], 7, [VersionSpan(0, 0), VersionSpan(1, 5)]),
        ([("7", 0, 0)], 0, [VersionSpan(7, 0)]),
    ],
)
def test_labels_become_version_spans(
    spans: list[tuple[str, int, int]], length: int, expected: list[VersionSpan]
) -> None:
    got = spans_from_labels([WeightVersionSpan(version=v, start=s, end=e) for v, s, e in spans], length)
    assert got == expected


def test_foreign_labels_and_gaps_are_the_servers_fault() -> None:
    with pytest.raises(InferenceError, match="not a stream-rl version"):
        label_version("rl-step-3")
    with pytest.raises(InferenceError, match="do not cover"):
        spans_from_labels([WeightVersionSpan(version="1", start=0, end=2)], 5)


def test_malformed_answers_and_statuses() -> None:
    def broken(choice_patch: dict[str, Any]) -> Any:
        body = recorded("generate.json")
        body["choices"][0].update(choice_patch)
        return body

    cases: list[tuple[Handler, type[Exception], str]] = [
        (vllm_handler([], broken({"weight_versions": None})), InferenceError, "no weight_versions"),
        (vllm_handler([], broken({"finish_reason": "abort"})), InferenceError, "ended with 'abort'"),
        (vllm_handler([], {"oops": True}), InferenceError, "unexpected vllm answer.*oops"),
        (
            lambda r: httpx.Response(400, json=recorded("error_400.json")),
            BadRequestError,
            "HTTP 400: max_tokens",
        ),
        (lambda r: httpx.Response(503, text="<html>busy</html>"), InferenceError, "HTTP 503: '<html>busy"),
        (lambda r: httpx.Response(200, text="not json"), InferenceError, "not JSON: 'not json'"),
    ]
    for handler, error, message in cases:
        client = client_for(VLLMClient, handler)
        with pytest.raises(error, match=message):
            asyncio.run(client.complete_many([{"role": "user", "content": "1+1="}], SamplingConfig(), n=2))


def test_builtin_client_parses_the_servers_own_response_model() -> None:
    response = ChatCompletionResponse(
        id="x",
        created=0,
        model="m",
        usage=Usage(prompt_tokens=2, completion_tokens=2, total_tokens=4),
        prompt_token_ids=[4, 5],
        choices=[
            ChatChoice(
                index=0,
                finish_reason="stop",
                token_ids=[7, 1],
                version_spans=[SpanBody(version=3, start=0), SpanBody(version=4, start=1)],
                message=AssistantMessage(content="7"),
                logprobs=ChatLogprobs(
                    content=[TokenLogprob(token="7", logprob=-0.5), TokenLogprob(token="", logprob=-0.1)]
                ),
            )
        ],
    )

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        return httpx.Response(200, json=response.model_dump(mode="json"))

    client = client_for(BuiltinClient, handle)
    (c,) = asyncio.run(client.complete_many([{"role": "user", "content": "3+4="}], SamplingConfig()))
    assert c.prompt_token_ids == [4, 5] and c.token_ids == [7, 1] and c.logprobs == [-0.5, -0.1]
    assert c.version_spans == [VersionSpan(3, 0), VersionSpan(4, 1)] and c.text == "7"


def test_make_client_picks_the_engine() -> None:
    assert type(make_client("vllm", "http://a/")).__name__ == "VLLMClient"
    assert make_client("builtin", "http://a/").base_url == "http://a"


# -- the vLLM guard (stream_rl/weights/vllm_guard.py) ----------------------------------------------


class FakeEngine:
    def __init__(self) -> None:
        self.paused = False
        self.resumed = 0

    async def is_paused(self) -> bool:
        return self.paused

    async def resume_generation(self) -> None:
        self.paused, self.resumed = False, self.resumed + 1


def guarded_app(engine: FakeEngine) -> Any:
    from fastapi import FastAPI

    from stream_rl.weights.vllm_guard import guard

    app = FastAPI()
    app.state.engine_client = engine
    app.middleware("http")(guard)

    @app.post("/pause")
    async def pause() -> dict[str, str]:
        engine.paused = True
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        await engine.resume_generation()
        return {"status": "resumed"}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, str]:
        return {"weight_version": "0"}

    return app


def test_the_guard_checks_the_token_and_resumes_a_pause_nobody_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAM_RL_ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("STREAM_RL_PAUSE_LEASE_S", "0.2")
    engine = FakeEngine()
    transport = httpx.ASGITransport(app=guarded_app(engine))
    auth = {"Authorization": "Bearer s3cret"}

    async def main() -> None:
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as http:
            denied = await http.post("/pause")
            assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
            assert (await http.post("/pause", headers={"Authorization": "Bearer nope"})).status_code == 401
            assert not engine.paused
            assert (await http.get("/weight_info")).status_code == 200  # open
            assert (await http.post("/pause", headers=auth)).status_code == 200 and engine.paused
            await asyncio.sleep(0.5)  # no /resume: the lease ends the pause
            assert not engine.paused and engine.resumed == 1
            assert (await http.post("/pause", headers=auth)).status_code == 200
            assert (await http.post("/resume", headers=auth)).status_code == 200
            await asyncio.sleep(0.4)
            assert engine.resumed == 2  # the resume disarmed the lease: no second resume by it

    asyncio.run(main())


class SessionEngine(FakeEngine):
    """A vLLM engine client with an update session, its label and the order of what it did."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.vllm_config = SimpleNamespace(weight_transfer_config=SimpleNamespace(backend=backend))
        self.label = "7"
        self.events: list[str] = []

    async def resume_generation(self) -> None:
        await super().resume_generation()
        self.events.append("resume")

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.events.append(f"finish {weight_version}")
        if weight_version is not None:
            self.label = weight_version

    async def update_weight_version(self, new_version: str) -> None:
        self.events.append(f"label {new_version}")
        self.label = new_version


def session_app(engine: SessionEngine) -> Any:
    from fastapi.responses import JSONResponse

    app = guarded_app(engine)

    @app.post("/start_weight_update")
    async def start() -> dict[str, str]:
        return {}

    @app.post("/update_weights")
    async def update() -> Any:
        return JSONResponse({"error": {"message": "NCCL error", "code": 500}}, status_code=500)

    return app


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("backend", ["nccl", "stream_rl_gloo"])
def test_a_lease_ending_an_update_session_labels_the_weights_before_decoding_resumes(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """nccl reloads layers from start on: the guard finishes the dead trainer's session under the
    incomplete label, then resumes; stream_rl_gloo installs nothing before finish: resume only."""
    from stream_rl.weights import vllm_guard
    from stream_rl.weights.vllm_guard import INCOMPLETE

    monkeypatch.delenv("STREAM_RL_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("STREAM_RL_PAUSE_LEASE_S", "0.1")
    monkeypatch.setitem(vllm_guard._session, "open", False)  # the server's state: one per test
    engine = SessionEngine(backend)
    transport = httpx.ASGITransport(app=session_app(engine))

    async def main() -> None:
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as http:
            assert (await http.post("/start_weight_update")).status_code == 200
            assert (await http.post("/pause")).status_code == 200
            await until(lambda: "resume" in engine.events)

    asyncio.run(main())
    if backend == "nccl":
        assert engine.events == [f"finish {INCOMPLETE}", f"label {INCOMPLETE}", "resume"]
        assert engine.label == INCOMPLETE
    else:
        assert engine.events == ["resume"] and engine.label == "7"


@pytest.mark.parametrize("backend", ["nccl", "stream_rl_gloo"])
def test_a_failed_update_labels_the_weights_incomplete_where_layers_may_be_loaded(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    from stream_rl.weights import vllm_guard
    from stream_rl.weights.vllm_guard import INCOMPLETE

    monkeypatch.delenv("STREAM_RL_ADMIN_TOKEN", raising=False)
    monkeypatch.setitem(vllm_guard._session, "open", False)
    engine = SessionEngine(backend)
    transport = httpx.ASGITransport(app=session_app(engine))

    async def main() -> None:
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as http:
            assert (await http.post("/update_weights")).status_code == 500  # no session: nothing to say
            assert engine.events == []
            assert (await http.post("/start_weight_update")).status_code == 200
            assert (await http.post("/update_weights")).status_code == 500

    asyncio.run(main())
    assert engine.label == (INCOMPLETE if backend == "nccl" else "7")


def test_the_actor_and_its_clients_do_not_import_torch() -> None:
    """The actor only talks HTTP to servers: its modules, every engine's client and the response
    types they parse into load without torch (which costs a stage process ~3 s of CPU to import;
    the request and result types live apart from the engine's running sequences for that)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import stream_rl.stages.actor, stream_rl.inference.clients, stream_rl.inference.protocol\n"
        "import stream_rl.inference.vllm_client, stream_rl.inference.sglang_client\n"
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

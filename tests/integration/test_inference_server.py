"""The HTTP server with a real tiny model, through the official `openai` client and raw HTTP:
OpenAI compatibility plus token ids, version spans and trainer-exact logprobs; concurrency;
every malformed or unauthorised request gets the right 4xx with a JSON error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fakes.server_thread import ServerThread, load_weights, random_weights
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_rl.config import SamplingConfig
from stream_rl.errors import BadRequestError, InferenceError
from stream_rl.inference.builtin_client import BuiltinClient
from stream_rl.inference.engine import Engine
from stream_rl.inference.model_maker import make_model

pytestmark = pytest.mark.integration

TOKEN = "admin-secret"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    path = make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    load_weights(model, random_weights(model, seed=5))  # outputs that vary (not one repeated token)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(
        Engine.load(model_dir, max_batch=16, seed=0), admin_token=TOKEN, model_name="tiny"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def recomputed_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:  # type: ignore[no-untyped-def]
    """What the trainer computes: log_softmax(logits / T) at the completion's tokens."""
    ids = torch.tensor([prompt + completion])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_openai_client_chat_with_logprobs(server: ServerThread, model_dir: Path, reference) -> None:  # type: ignore[no-untyped-def]
    from openai import OpenAI  # here, not at collection: ~1.7 s of import in each xdist worker

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "37+45="}]
    response = client.chat.completions.create(
        model="tiny",
        messages=messages,
        logprobs=True,
        top_logprobs=3,
        max_tokens=12,
        temperature=0.8,
        seed=1,
        n=2,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert response.model_extra["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert len(response.choices) == 2
    for choice in response.choices:
        token_ids = choice.model_extra["token_ids"]
        assert choice.model_extra["version_spans"] == [{"version": 0, "start": 0}]
        assert choice.finish_reason in ("stop", "length")
        content = choice.logprobs.content
        assert len(content) == len(token_ids) >= 1
        assert [c.token for c in content] == [tokenizer.decode([t]) for t in token_ids]
        assert all(len(c.top_logprobs) == 3 and c.bytes for c in content)
        expected = recomputed_logprobs(reference, response.model_extra["prompt_token_ids"], token_ids, 0.8)
        assert [c.logprob for c in content] == pytest.approx(expected, abs=1e-4)
        assert choice.message.content == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert response.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in response.choices)


def test_completions_with_token_ids_greedy_matches_transformers(server: ServerThread, reference) -> None:  # type: ignore[no-untyped-def]
    from openai import OpenAI  # here, not at collection: ~1.7 s of import in each xdist worker

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    prompt = [4, 57, 61, 49, 58, 59, 67, 1, 5]
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, logprobs=0
    )
    with torch.inference_mode():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = out[0, len(prompt) :].tolist()
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == expected[: len(choice.model_extra["token_ids"])]
    assert response.model_extra["prompt_token_ids"] == prompt
    assert len(choice.logprobs.token_logprobs) == len(choice.model_extra["token_ids"])


def test_stop_string_over_http(server: ServerThread) -> None:
    body = {"prompt": [4, 50, 51, 1, 5], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    free = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    text = free["text"]
    stop = next(
        text[i : i + 2]
        for i in range(2, len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].isprintable()
    )
    stopped = httpx.post(f"{server.url}/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == text[: text.index(stop)]
    assert stopped["token_ids"] == free["token_ids"][: len(stopped["token_ids"])]


def test_64_concurrent_requests_are_all_answered(server: ServerThread) -> None:
    async def main() -> list[int]:
        async with BuiltinClient(server.url) as client:
            sampling = SamplingConfig(temperature=1.0, max_tokens=24)
            prompts = [[4, *range(6 + i % 50, 6 + i % 50 + 1 + i % 13), 1, 5] for i in range(64)]
            results = await asyncio.gather(
                *(client.complete(p, sampling, seed=i) for i, p in enumerate(prompts))
            )
            for prompt, c in zip(prompts, results, strict=True):
                assert c.prompt_token_ids == prompt
                assert len(c.logprobs) == len(c.token_ids) >= 1
                assert c.finish_reason in ("stop", "length")
            return [len(c.token_ids) for c in results]

    lengths = asyncio.run(main())
    assert len(lengths) == 64 and all(1 <= n <= 24 for n in lengths)


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", b"[1, 2]", "dictionary"),
        ("/v1/completions", b'{"prompt": "x", "frequency_penalty": 0.5}', "frequency_penalty: unknown field"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
        ("/v1/completions", b'{"prompt": [1, -2]}', "prompt"),
        ("/v1/completions", b'{"prompt": ""}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "temperature": -1}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "stream": true}', "stream"),
        ("/v1/completions", b'{"prompt": [999999]}', "token ids"),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', "role"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "content"),
    ],
)
def test_malformed_requests_get_400_with_json_error(
    server: ServerThread, path: str, body: bytes, fragment: str
) -> None:
    response = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/weights/version", "/weights/meta"])
def test_admin_token_guards_weight_routes(server: ServerThread, path: str) -> None:
    assert httpx.get(f"{server.url}{path}").status_code == 401
    wrong = httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "admin token" in wrong.json()["error"]["message"]
    assert httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    post = httpx.post(f"{server.url}/weights/update", json={"version": 1, "tensors": [], "bucket_bytes": 1})
    assert post.status_code == 401  # authentication is checked before the body is looked at


def test_weight_routes_validate_bodies(server: ServerThread) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{server.url}/weights"
    bad_group = {"master_addr": "127.0.0.1", "master_port": 1, "rank": 2, "world_size": 2, "backend": "gloo"}
    assert httpx.post(f"{url}/init_group", json=bad_group, headers=auth).status_code == 400
    assert (
        httpx.post(f"{url}/init_group", json={**bad_group, "backend": "mpi"}, headers=auth).status_code == 400
    )
    meta = httpx.get(f"{url}/meta", headers=auth).json()
    good = {"version": 1, "tensors": meta[:1], "bucket_bytes": 1 << 20}
    no_group = httpx.post(f"{url}/update", json=good, headers=auth)
    assert no_group.status_code == 409 and "init_group" in no_group.json()["error"]["message"]
    unknown = {**good, "tensors": [{"name": "nope.weight", "dtype": "float32", "shape": [1]}]}
    assert (
        "no such parameter"
        in httpx.post(f"{url}/update", json=unknown, headers=auth).json()["error"]["message"]
    )
    shape = {**good, "tensors": [{**meta[0], "shape": [1, 2]}]}
    assert httpx.post(f"{url}/update", json=shape, headers=auth).status_code == 400
    dtype = {**good, "tensors": [{**meta[0], "dtype": "bfloat16"}]}
    assert "dtype" in httpx.post(f"{url}/update", json=dtype, headers=auth).json()["error"]["message"]
    tied = {**good, "tensors": [meta[0], {**meta[0], "name": "lm_head.weight"}]}
    assert "tied" in httpx.post(f"{url}/update", json=tied, headers=auth).json()["error"]["message"]
    assert httpx.post(f"{url}/update", json={**good, "bucket_bytes": 0}, headers=auth).status_code == 400


def test_health_models_and_metrics(server: ServerThread) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "version": 0}
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["version"] == 0
    httpx.post(f"{server.url}/v1/completions", json={"prompt": [4, 5], "max_tokens": 3})
    text = httpx.get(f"{server.url}/metrics").text
    for series in (
        "running",
        "waiting",
        "tokens_per_second",
        "weight_version",
        "generated_tokens_total",
        "busy_seconds_total",
    ):
        assert f"stream_rl_inference_{series}" in text
    assert 'stream_rl_inference_requests_total{endpoint="completions",status="200"}' in text
    assert "stream_rl_inference_weight_update_stall_seconds_count" in text


def test_client_chat_health_version_and_errors(server: ServerThread, model_dir: Path) -> None:
    async def main() -> None:
        async with BuiltinClient(server.url) as client:
            messages = [{"role": "user", "content": "2+2="}]
            completion = await client.complete(
                messages, SamplingConfig(max_tokens=6, temperature=1.0), seed=3
            )
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            assert completion.prompt_token_ids == tokenizer.encode(
                "<|user|>2+2=<|end|><|assistant|>", add_special_tokens=False
            )
            assert len(completion.logprobs) == len(completion.token_ids) >= 1
            assert completion.version_spans[0].version == 0
            again = await client.complete(messages, SamplingConfig(max_tokens=6, temperature=1.0), seed=3)
            assert again.token_ids == completion.token_ids  # seeded
            many = await client.complete_many([4, 9, 1, 5], SamplingConfig(max_tokens=5), n=3)
            assert len(many) == 3 and all(c.prompt_token_ids == [4, 9, 1, 5] for c in many)
            await client.health()
            assert await client.version() == 0  # public: /v1/models, no admin token needed
            with pytest.raises(BadRequestError, match="HTTP 400.*token ids") as bad:
                await client.complete([999_999], SamplingConfig())
            assert bad.value.status == 400
        async with BuiltinClient("http://127.0.0.1:9") as nowhere:
            with pytest.raises(InferenceError, match="failed"):
                await nowhere.health()

    asyncio.run(main())


def test_engine_failure_answers_503_and_health_reports_it(model_dir: Path) -> None:
    engine = Engine.load(model_dir, max_batch=4)

    def broken_forward(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated kernel failure")

    with ServerThread(engine) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        engine.model.forward = broken_forward  # the next prefill fails inside the engine loop
        failed = httpx.post(f"{server.url}/v1/completions", json={"prompt": [4, 5], "max_tokens": 3})
        assert failed.status_code == 503 and "simulated kernel failure" in failed.json()["error"]["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        after = httpx.post(f"{server.url}/v1/completions", json={"prompt": [4, 5], "max_tokens": 3})
        assert after.status_code == 503 and "not running" in after.json()["error"]["message"]

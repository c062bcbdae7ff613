"""The SGLang client against recorded SGLang 0.5.23 answers (tests/data/sglang-0.5.23/: built with
SGLang's own response classes and weight-version code, README.md there), its request bodies
(kept equal to the files sglang_bodies.py validates with SGLang's request classes, and checked
here against a labelled copy of the constraints those classes enforce), and its errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from stream_rl.config import SamplingConfig
from stream_rl.contracts import VersionSpan
from stream_rl.errors import BadRequestError, InferenceError
from stream_rl.inference.client import make_client
from stream_rl.inference.sglang_client import SGLangClient, chat_body, generate_body, sample_seeds

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[1] / "data" / "sglang-0.5.23"
SAMPLING = SamplingConfig(temperature=0.7, top_p=1.0, top_k=0, max_tokens=8, stop=["\n\n"])
MESSAGES = [{"role": "user", "content": "What is 37+45?"}]
PROMPT_IDS = [785, 2629, 315, 220, 18, 22, 10, 19, 20, 28]
Handler = Callable[[httpx.Request], httpx.Response]

# A faithful copy, NOT SGLang's code, of what 0.5.23 enforces on the fields we send (checked against
# the real classes by sglang_bodies.py check): /generate's sampling params reject unknown keys
# (sglang/api/v1/api_types.py:177-207), top_k must be -1 or >= 1 (srt/sampling/sampling_params.py:
# 248-266), the chat fields exist on ChatCompletionRequest (srt/entrypoints/openai/protocol.py:909-1063).
GENERATE_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
}  # fmt: skip
GENERATE_KEYS = {
    "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "stream",
}  # fmt: skip
CHAT_KEYS = {
    "messages", "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_tokens",
    "logprobs", "return_token_ids", "return_meta_info", "stream", "stop", "seed",
}  # fmt: skip


def recorded(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def client_for(handler: Handler) -> SGLangClient:
    return SGLangClient("http://sglang", http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def answering(calls: list[tuple[str, Any]], **answers: Any) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        calls.append((request.url.path, body))
        answer = answers.get(request.url.path.strip("/").replace("/", "_"))
        if answer is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        if isinstance(answer, httpx.Response):
            return answer
        return httpx.Response(200, json=answer)

    return handle


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_request_bodies_are_the_files_validated_against_sglang_and_keep_its_constraints() -> None:
    chat = chat_body(MESSAGES, SAMPLING, 1234)
    generate = generate_body(PROMPT_IDS, SAMPLING, sample_seeds(1234, 2))
    assert chat == recorded("request_chat.json")
    assert generate == recorded("request_generate.json")
    assert set(chat) <= CHAT_KEYS and set(generate) <= GENERATE_KEYS
    for params in generate["sampling_params"]:
        assert set(params) <= GENERATE_SAMPLING_KEYS
        assert params["top_k"] == -1 or params["top_k"] >= 1
    assert chat["top_k"] == -1
    assert (
        generate_body(PROMPT_IDS, SAMPLING.model_copy(update={"top_k": 5}), [None])["sampling_params"][0][
            "top_k"
        ]
        == 5
    )
    # Sample i has seed + i: one shared seed would give identical samples in SGLang's seeded sampler.
    assert [p["sampling_seed"] for p in generate["sampling_params"]] == [1234, 1235]
    assert sample_seeds(0x7FFFFFFF, 2) == [0x7FFFFFFF, 0]
    assert "sampling_seed" not in generate_body(PROMPT_IDS, SAMPLING, [None])["sampling_params"][0]
    assert "seed" not in chat_body(MESSAGES, SAMPLING, None)


def test_chat_maps_token_ids_logprobs_and_per_token_versions() -> None:
    calls: list[tuple[str, Any]] = []
    client = client_for(answering(calls, v1_chat_completions=recorded("chat_completion.json")))
    completions = run(client.complete_many(MESSAGES, SAMPLING, n=2, seed=7))
    assert [path for path, _ in calls] == ["/v1/chat/completions"] * 2  # one sample per request
    assert sorted(body["seed"] for _, body in calls) == [7, 8]
    assert all(body["n"] == 1 and body["messages"] == MESSAGES for _, body in calls)
    c = completions[0]
    choice = recorded("chat_completion.json")["choices"][0]
    assert c.prompt_token_ids == choice["prompt_token_ids"]
    assert c.token_ids == choice["response_token_ids"]
    assert c.logprobs == [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert c.version_spans == [VersionSpan(3, 0), VersionSpan(4, 6)]
    assert c.text == "37+45=82" and c.finish_reason == "stop"


def test_token_ids_go_to_generate_one_item_per_sample_each_with_its_own_versions() -> None:
    calls: list[tuple[str, Any]] = []
    client = client_for(answering(calls, generate=recorded("generate.json")))
    first, second = run(client.complete_many(PROMPT_IDS, SAMPLING, n=2, seed=1234))
    assert calls == [("/generate", recorded("request_generate.json"))]
    items = recorded("generate.json")
    assert first.prompt_token_ids == PROMPT_IDS and first.token_ids == items[0]["output_ids"]
    assert first.logprobs == [lp for lp, _, _ in items[0]["meta_info"]["output_token_logprobs"]]
    assert first.version_spans == [VersionSpan(3, 0), VersionSpan(4, 6)]
    assert second.version_spans == [VersionSpan(3, 0)]
    assert (first.text, second.text) == ("37+45=82", "37+45=81")


def test_version_reads_model_info_and_labels_map_to_versions() -> None:
    calls: list[tuple[str, Any]] = []
    assert run(client_for(answering(calls, model_info=recorded("model_info.json"))).version()) == 4
    assert run(client_for(answering(calls, model_info={"weight_version": "default"})).version()) == 0
    with pytest.raises(InferenceError, match="stream-rl-incomplete"):
        run(client_for(answering(calls, model_info={"weight_version": "stream-rl-incomplete"})).version())


def test_health_takes_an_empty_200_and_make_client_picks_this_client() -> None:
    calls: list[tuple[str, Any]] = []
    run(client_for(answering(calls, health=httpx.Response(200))).health())
    assert calls == [("/health", None)]
    assert isinstance(make_client("sglang", "http://x"), SGLangClient)


def _bad(mutate: Callable[[Any], None]) -> Any:
    body = recorded("generate.json")
    mutate(body)
    return body


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (httpx.Response(200, content=b"<html>oops</html>"), "not JSON.*oops"),
        ({"text": "one item, not a list"}, "unexpected sglang answer.*one item"),
        (_bad(lambda b: b.pop()), "1 samples for n=2"),
        (_bad(lambda b: b[0]["meta_info"].pop("weight_versions")), "weight_versions"),
        (_bad(lambda b: b[0]["meta_info"].update(finish_reason={"type": "abort"})), "ended with 'abort'"),
        (_bad(lambda b: b[0]["output_ids"].append(5)), "do not match output_ids"),
        (_bad(lambda b: b[0]["meta_info"]["weight_versions"][-1].update(end=4)), "do not cover"),
        (httpx.Response(503, text="Service Unavailable"), "HTTP 503"),
    ],
)
def test_unexpected_answers_are_inference_errors_quoting_the_body(answer: Any, match: str) -> None:
    client = client_for(answering([], generate=answer))
    with pytest.raises(InferenceError, match=match) as caught:
        run(client.complete_many(PROMPT_IDS, SAMPLING, n=2))
    assert not isinstance(caught.value, BadRequestError)


def test_chat_without_token_ids_or_meta_info_is_an_inference_error() -> None:
    for field in ("response_token_ids", "meta_info"):
        body = recorded("chat_completion.json")
        body["choices"][0].pop(field)
        with pytest.raises(InferenceError, match="response_token_ids|meta_info"):
            run(client_for(answering([], v1_chat_completions=body)).complete(MESSAGES, SAMPLING))


def test_a_400_is_the_requests_fault_with_sglangs_message() -> None:
    # serving_base.py:205-221 (OpenAI routes) and http_server.py:2246-2250 (/generate)
    chat_error = {"object": "error", "message": "top_k must be -1 (disable) or at least 1, got 0.",
                  "type": "BadRequestError", "param": None, "code": 400}  # fmt: skip
    client = client_for(answering([], v1_chat_completions=httpx.Response(400, json=chat_error)))
    with pytest.raises(BadRequestError, match="top_k must be -1"):
        run(client.complete(MESSAGES, SAMPLING))
    generate_error = {"error": {"message": "input_ids cannot be empty."}}
    client = client_for(answering([], generate=httpx.Response(400, json=generate_error)))
    with pytest.raises(BadRequestError, match="input_ids cannot be empty"):
        run(client.complete(PROMPT_IDS, SAMPLING))

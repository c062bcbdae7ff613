"""The client of a vLLM server (`vllm serve` with the flags the launcher passes, docs/engines.md "Engines").

Each request takes two calls, both routes of vLLM's own API (`--enable-scale-out`):
1. render: `POST /v1/chat/completions/render` (chat messages: vLLM applies the model's chat
   template) or `POST /v1/completions/render` (token ids), with the OpenAI sampling fields. vLLM
   validates them (a prompt that does not fit the context is a 400 here) and answers the
   `GenerateRequest` it would run: the prompt's token ids and vLLM's sampling parameters.
2. generate: `POST /inference/v1/generate` with that body and `"output_mode": "text"`. Each
   choice carries `token_ids`, `logprobs.content[j].logprob` (with `--logprobs-mode
   processed_logprobs`: `log_softmax(logits / T)`), `text`, `finish_reason` and
   `weight_versions: [{version, start, end}]`: the weight label in force for each token.
The token-in/token-out route is used because it is the one that reports `weight_versions` in
vLLM 0.32 (the CPU build verified here) and 0.33 alike; 0.33's OpenAI routes also report them
with `return_weight_versions`, 0.32's do not.

Version labels: the trainer sets the label of every update it installs to its version number
(`POST /finish_weight_update {"weight_version": "N"}`). A server that no trainer has updated
yet is labelled `default`: it serves the weights it loaded from `model.path`, which are version
0's, so `default` reads as version 0. `stream-rl-incomplete` (an update that did not finish:
some weights may be new) is refused until the next update. Any other label is an error (a server
some other trainer updates). Consecutive spans that map to the same version are merged.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from stream_rl.config import SamplingConfig
from stream_rl.contracts.core import INCOMPLETE, VersionSpan
from stream_rl.errors import InferenceError
from stream_rl.inference.builtin_client import InferenceClient, Prompt, is_chat, quote
from stream_rl.inference.completion import Completion

DEFAULT_LABEL = "default"
"""vLLM's label before the first update (`vllm/v1/engine/core.py`)."""


def label_version(label: str) -> int:
    """The version number of a vLLM weight label (`"default"` is version 0)."""
    if label == DEFAULT_LABEL:
        return 0
    if label.isdigit():
        return int(label)
    if label == INCOMPLETE:
        raise InferenceError(
            f"weight version label {INCOMPLETE!r}: an update did not finish on this server, so no "
            "version describes its weights until the trainer pushes the next one"
        )
    raise InferenceError(f"weight version label {label!r} is not a stream-rl version (a number or 'default')")


def spans_from_labels(spans: list[WeightVersionSpan], length: int) -> list[VersionSpan]:
    """vLLM's `[{version, start, end}]` as our spans (merged where the versions are equal)."""
    out: list[VersionSpan] = []
    for span in spans:
        version = label_version(span.version)
        if not out or out[-1].version != version:
            out.append(VersionSpan(version, span.start))
    if length and (not out or out[0].start != 0 or spans[-1].end != length):
        raise InferenceError(
            f"weight_versions {[s.model_dump() for s in spans]} do not cover {length} tokens"
        )
    return out


class WeightVersionSpan(BaseModel):
    version: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class TokenLogprob(BaseModel):
    logprob: float


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class GenerateChoice(BaseModel):
    index: int
    finish_reason: str | None
    token_ids: list[int]
    text: str
    logprobs: ChoiceLogprobs | None
    weight_versions: list[WeightVersionSpan] | None


class GenerateResponse(BaseModel):
    choices: list[GenerateChoice]


class RenderedRequest(BaseModel):
    """What matters to us of vLLM's `GenerateRequest` (the rest is passed through as is)."""

    token_ids: list[int]


class VLLMClient(InferenceClient):
    engine = "vllm"
    BUSY_STATUSES = (503,)
    """vLLM 0.33 answers 503 (`RetryableRequestError`, "Generation is paused. Please retry after it
    resumes.") to new requests while a `wait`-mode pause drains it for a weight update
    (`in_flight_updates: false`), and to requests beyond its queue limits; 0.32 queues them."""

    async def complete_many(
        self, prompt: Prompt, sampling: SamplingConfig, *, n: int = 1, seed: int | None = None
    ) -> list[Completion]:
        body: dict[str, Any] = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,  # vLLM: 0 (or -1) is off
            # Sent as the neutral values so that no server default applies (a server started with
            # `--generation-config auto` fills unset fields from the model's generation_config.json:
            # Qwen2.5-Instruct's repetition_penalty 1.05 would bias sampling and every logprob).
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "max_tokens": sampling.max_tokens,
            "n": n,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if seed is not None:
            body["seed"] = seed
        if is_chat(prompt):
            path = "/v1/chat/completions/render"
            rendered = await self.call(
                "POST", path, {**body, "messages": prompt, "logprobs": True, "top_logprobs": 0}
            )
        else:
            path = "/v1/completions/render"
            answer = await self.call("POST", path, {**body, "prompt": prompt, "logprobs": 0})
            if not isinstance(answer, list) or len(answer) != 1:
                raise InferenceError(
                    f"{self.base_url}{path}: expected one rendered request, got {quote(json.dumps(answer))}"
                )
            rendered = answer[0]
        if not isinstance(rendered, dict):
            raise InferenceError(f"{self.base_url}{path}: unexpected answer {quote(json.dumps(rendered))}")
        prompt_ids = self.parse(RenderedRequest, rendered, path).token_ids
        rendered = {**rendered, "output_mode": "text", "stream": False}
        rendered.pop("request_id", None)  # vLLM draws a fresh one: ids must be unique among requests
        response = self.parse(
            GenerateResponse,
            await self.call("POST", "/inference/v1/generate", rendered),
            "/inference/v1/generate",
        )
        if len(response.choices) != n:
            raise InferenceError(
                f"{self.base_url}/inference/v1/generate: {len(response.choices)} choices for n={n}"
            )
        return [
            self._completion(prompt_ids, choice) for choice in sorted(response.choices, key=lambda c: c.index)
        ]

    def _completion(self, prompt_ids: list[int], choice: GenerateChoice) -> Completion:
        where = f"{self.base_url}/inference/v1/generate"
        if choice.finish_reason not in ("stop", "length"):
            raise InferenceError(f"{where}: choice {choice.index} ended with {choice.finish_reason!r}")
        if choice.logprobs is None or len(choice.logprobs.content) != len(choice.token_ids):
            raise InferenceError(f"{where}: choice {choice.index} has no logprob for every token")
        if choice.weight_versions is None:
            raise InferenceError(f"{where}: choice {choice.index} has no weight_versions")
        return Completion(
            prompt_token_ids=prompt_ids,
            token_ids=choice.token_ids,
            logprobs=[entry.logprob for entry in choice.logprobs.content],
            version_spans=spans_from_labels(choice.weight_versions, len(choice.token_ids)),
            text=choice.text,
            finish_reason=choice.finish_reason,
        )

    async def version(self) -> int | None:
        data = await self.call("GET", "/weight_info")
        label = data.get("weight_version") if isinstance(data, dict) else None
        if not isinstance(label, str):
            raise InferenceError(
                f"{self.base_url}/weight_info: no weight_version in {quote(json.dumps(data))}"
            )
        return label_version(label)

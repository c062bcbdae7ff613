"""The client of an SGLang server (`python -m sglang.launch_server` with the flags the launcher
passes, docs/engines.md "SGLang"). Written to SGLang 0.5.23's HTTP API as read from its wheel; UNVERIFIED
(SGLang cannot run on our CPU machines). File:line references are inside that wheel.

- Chat prompts: `POST /v1/chat/completions` (SGLang applies the model's chat template) with
  `return_token_ids` (per choice `prompt_token_ids` and `response_token_ids`,
  serving_chat.py:2976-2983), `return_meta_info` (per choice `meta_info`, the engine's own
  record of that sample, with `weight_versions`, serving_chat.py:2985-2987), `logprobs: true`
  (`logprobs.content[j].logprob`, one per output token, serving_chat.py:3053-3060).
- Token-id prompts: `POST /generate` with `input_ids`. `/v1/completions` also takes token ids,
  but it reports weight versions only once per response, from its first choice
  (`metadata`, serving_completions.py:645, utils/weight_versions.py:113-117); `/generate`
  answers one item per sample, each with its own `output_ids` and `meta_info`
  (`weight_versions`, `output_token_logprobs` as `[logprob, token_id, text]`,
  tokenizer_manager.py:2560-2567, 2868-2870, 3105-3108).
- n samples are n requests (chat) or n items of one batch (`/generate`), never SGLang's `n`:
  its parallel sampling first runs a prefill that only primes the radix cache
  (tokenizer_manager.py:2131-2151), which the launcher disables, and one seed shared by n
  samples would give n identical samples (the seeded sampler hashes seed and position only,
  layers/sampler.py:934-958). Sample i gets seed `seed + i`.
- Seeds go as `seed` (chat, mapped to `sampling_seed`, protocol.py:1233) or
  `sampling_params.sampling_seed` (`/generate`). SGLang uses them only when started with
  `--enable-deterministic-inference` (sampling/sampling_batch_info.py:157-172); the launcher
  passes it when `actor.seeded_sampling` is on.
- Sampling: `top_k: 0` (ours: off) is sent as -1, SGLang's "off" (0 is a 400,
  sampling/sampling_params.py:248-266). `min_p` and `repetition_penalty` are always sent: a chat
  request that leaves them out gets the model's `generation_config.json` values
  (protocol.py:1197-1203), which would change the sampling distribution behind the trainer's back.
  SGLang's logprobs are `log_softmax(logits / T)` of the full distribution, before top-k/top-p
  (layers/sampler.py:274-318), what the trainer recomputes.
- Versions: the trainer labels every update `str(version)` and the launcher starts servers with
  `--weight-version 0`; `[{version, start, end}]` spans map to our `VersionSpan`s as vLLM's do
  (`vllm_client.spans_from_labels`: a number, or `default` for a server started without the
  flag, which holds version 0's weights). `version()` reads `GET /model_info` (`weight_version`,
  http_server.py:812-826; `/get_model_info` is its deprecated alias).
- `GET /health` answers 200 with an empty body (http_server.py:721-799).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pydantic import BaseModel, Field, RootModel

from stream_rl.config import SamplingConfig
from stream_rl.errors import InferenceError
from stream_rl.inference.builtin_client import InferenceClient, Messages, Prompt, is_chat, quote
from stream_rl.inference.completion import Completion
from stream_rl.inference.vllm_client import WeightVersionSpan, label_version, spans_from_labels

SEED_MASK = 0x7FFFFFFF
OFF_TOP_K = -1
"""SGLang's "no top-k" (sampling_params.py:248-249)."""


def sample_seeds(seed: int | None, n: int) -> list[int | None]:
    """One seed per sample: `seed + i` (31 bits), or none."""
    return [None] * n if seed is None else [(seed + i) & SEED_MASK for i in range(n)]


def chat_body(messages: Messages, sampling: SamplingConfig, seed: int | None) -> dict[str, Any]:
    """One `/v1/chat/completions` request: one sample with token ids, logprobs and meta_info."""
    body: dict[str, Any] = {
        "messages": messages,
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k or OFF_TOP_K,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_completion_tokens": sampling.max_tokens,
        "logprobs": True,
        "return_token_ids": True,
        "return_meta_info": True,
        "stream": False,
    }
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if seed is not None:
        body["seed"] = seed
    return body


def generate_body(prompt_ids: list[int], sampling: SamplingConfig, seeds: list[int | None]) -> dict[str, Any]:
    """One `/generate` batch: the prompt once per sample, each with its own sampling params."""
    params = []
    for seed in seeds:
        p: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or OFF_TOP_K,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
        }
        if sampling.stop:
            p["stop"] = list(sampling.stop)
        if seed is not None:
            p["sampling_seed"] = seed
        params.append(p)
    return {
        "input_ids": [list(prompt_ids) for _ in seeds],
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,  # output tokens only
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
        "stream": False,
    }


# -- what we read of SGLang's answers (unknown fields ignored) ------------------------------------


class MetaInfo(BaseModel):
    weight_versions: list[WeightVersionSpan]


class FinishReason(BaseModel):
    type: str


class GenerateMeta(MetaInfo):
    finish_reason: FinishReason | None
    output_token_logprobs: list[tuple[float, int, str | None]]


class GenerateItem(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


class GenerateAnswer(RootModel[list[GenerateItem]]):
    pass


class TokenLogprob(BaseModel):
    logprob: float


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessage(BaseModel):
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    meta_info: MetaInfo | None = None


class ChatAnswer(BaseModel):
    choices: list[ChatChoice] = Field(min_length=1, max_length=1)


class ModelInfo(BaseModel):
    weight_version: str


class SGLangClient(InferenceClient):
    engine = "sglang"

    async def complete_many(
        self, prompt: Prompt, sampling: SamplingConfig, *, n: int = 1, seed: int | None = None
    ) -> list[Completion]:
        seeds = sample_seeds(seed, n)
        if is_chat(prompt):
            messages: Messages = prompt  # type: ignore[assignment]
            return list(await asyncio.gather(*(self._chat(messages, sampling, s) for s in seeds)))
        prompt_ids: list[int] = prompt  # type: ignore[assignment]
        path = "/generate"
        data = await self.call("POST", path, generate_body(prompt_ids, sampling, seeds))
        items = self.parse(GenerateAnswer, data, path).root
        if len(items) != n:
            raise InferenceError(
                f"{self.base_url}{path}: {len(items)} samples for n={n}: {quote(json.dumps(data))}"
            )
        return [self._generated(prompt_ids, item, j) for j, item in enumerate(items)]

    async def _chat(self, messages: Messages, sampling: SamplingConfig, seed: int | None) -> Completion:
        path = "/v1/chat/completions"
        data = await self.call("POST", path, chat_body(messages, sampling, seed))
        choice = self.parse(ChatAnswer, data, path).choices[0]
        where = f"{self.base_url}{path}"
        if choice.prompt_token_ids is None or choice.response_token_ids is None:
            raise InferenceError(
                f"{where}: no prompt_token_ids/response_token_ids: {quote(json.dumps(data))}"
            )
        if choice.meta_info is None:
            raise InferenceError(f"{where}: no meta_info: {quote(json.dumps(data))}")
        tokens = choice.response_token_ids
        if choice.logprobs is None or len(choice.logprobs.content) != len(tokens):
            raise InferenceError(f"{where}: not one logprob per token: {quote(json.dumps(data))}")
        return Completion(
            prompt_token_ids=choice.prompt_token_ids,
            token_ids=tokens,
            logprobs=[entry.logprob for entry in choice.logprobs.content],
            version_spans=spans_from_labels(choice.meta_info.weight_versions, len(tokens)),
            text=choice.message.content or "",
            finish_reason=_finished(where, choice.finish_reason),
        )

    def _generated(self, prompt_ids: list[int], item: GenerateItem, j: int) -> Completion:
        where = f"{self.base_url}/generate (sample {j})"
        meta = item.meta_info
        logprobs = meta.output_token_logprobs
        if [token for _, token, _ in logprobs] != item.output_ids:
            raise InferenceError(f"{where}: output_token_logprobs do not match output_ids")
        reason = meta.finish_reason.type if meta.finish_reason is not None else None
        return Completion(
            prompt_token_ids=list(prompt_ids),
            token_ids=item.output_ids,
            logprobs=[logprob for logprob, _, _ in logprobs],
            version_spans=spans_from_labels(meta.weight_versions, len(item.output_ids)),
            text=item.text,
            finish_reason=_finished(where, reason),
        )

    async def version(self) -> int | None:
        path = "/model_info"
        return label_version(self.parse(ModelInfo, await self.call("GET", path), path).weight_version)


def _finished(where: str, reason: str | None) -> str:
    if reason not in ("stop", "length"):
        raise InferenceError(f"{where}: the sample ended with {reason!r} (expected stop or length)")
    return reason

"""HTTP request and response bodies of the built-in inference server (pydantic): the one typed
contract between the server (`openai_routes.py`, `weights_routes.py`) and our client
(`stream_rl.inference.builtin_client.BuiltinClient`), which parses responses with these same models.

Requests forbid unknown fields (an unknown or mistyped field is a 400 with a JSON error naming
it). The OpenAI-compatible bodies accept the OpenAI fields this engine honours, plus the
extensions `top_k` and `ignore_eos`; every choice carries `token_ids` and `version_spans`, every
response `prompt_token_ids`. Responses are OpenAI's shapes with those extensions, so the official
`openai` client reads them unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from stream_rl.contracts.core import VersionSpan
from stream_rl.inference.requests import SamplingParams

MAX_STOP = 8  # stop strings per request


class Body(BaseModel):
    """Base of request bodies: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


class _Sampling(Body):
    model: str | None = None
    """Accepted and echoed: a server serves one model (GET /v1/models names it)."""
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    """Extension (0 = off). Keep 0 and top_p = 1 for RL: logprobs are of the full distribution."""
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: Literal[False] = False
    """Streaming is not supported."""
    ignore_eos: bool = False
    """Extension: keep sampling after eos (benchmarks)."""
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop: at most {MAX_STOP} non-empty strings")
        return value

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self, max_tokens: int | None, default_max_tokens: int, top_logprobs: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens or default_max_tokens,
            stop=self.stops(),
            n=self.n,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            top_logprobs=top_logprobs,
        )


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessageBody(Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageBody] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    """Extension: append the assistant turn's opening to the prompt (chat template)."""


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class TextCompletionRequest(_Sampling):
    prompt: str | TokenIds
    """One prompt: text, or token ids (used as is, no special tokens added)."""
    logprobs: int | None = Field(None, ge=0, le=20)
    """Return per-token logprobs and this many top alternatives (0: the sampled token only)."""

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list[int]) -> str | list[int]:
        if not value:
            raise ValueError("prompt must not be empty")
        return value


class InitGroupRequest(Body):
    master_addr: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)
    """This server's rank in the weight-sync group (rank 0 is the trainer)."""
    world_size: int = Field(ge=2)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float | None = Field(None, gt=0)
    """Extension: collective timeout (default: the server's --weights-timeout)."""


class TensorSpec(Body):
    name: str = Field(min_length=1)
    dtype: Literal["float32", "bfloat16", "float16"]
    shape: list[Annotated[StrictInt, Field(ge=0)]]


class UpdateWeightsRequest(Body):
    version: int = Field(ge=0)
    tensors: list[TensorSpec]
    """Any subset of `GET /weights/meta`, possibly empty: a delta push whose tensors all stayed
    within the threshold only relabels the weights held as `version` (docs/weights-protocol.md)."""
    bucket_bytes: int = Field(ge=1)


class InitIpcRequest(Body):
    """`POST /weights/init_ipc`: the trainer, on the GPU `device_uuid`, offers CUDA IPC updates."""

    device_uuid: str = Field(min_length=1)
    torch_version: str = Field(min_length=1)


class IpcHandle(Body):
    """One shared bucket (`stream_rl.weights.ipc.share`): torch's CUDA IPC fields, bytes in base64."""

    device: int = Field(ge=0)
    handle: str
    storage_size: int = Field(ge=0)
    storage_offset: int = Field(ge=0)
    offset: int = Field(ge=0)
    numel: int = Field(ge=0)
    ref_counter_handle: str
    ref_counter_offset: int = Field(ge=0)
    event_handle: str | None = None
    event_sync_required: bool


class UpdateIpcRequest(UpdateWeightsRequest):
    """`POST /weights/update_ipc`: an update whose buckets are shared, one handle per non-empty bucket."""

    buckets: list[IpcHandle]


# -- responses ---------------------------------------------------------------------------------


class SpanBody(BaseModel):
    """Completion tokens from `start` on (until the next span) were sampled by weights `version`."""

    version: int = Field(ge=0)
    start: int = Field(ge=0)

    def span(self) -> VersionSpan:
        return VersionSpan(self.version, self.start)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None


class _Choice(BaseModel):
    index: int = Field(ge=0)
    finish_reason: Literal["stop", "length"]
    token_ids: list[int]
    """Extension: every sampled token id, end of sequence included."""
    version_spans: list[SpanBody]
    """Extension: the weight version of every sampled token."""

    def output_text(self) -> str:
        raise NotImplementedError

    def token_logprobs(self) -> list[float]:
        raise NotImplementedError


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None

    def output_text(self) -> str:
        return self.message.content or ""

    def token_logprobs(self) -> list[float]:
        if self.logprobs is None:
            raise ValueError("the choice has no logprobs (ask with logprobs: true)")
        return [entry.logprob for entry in self.logprobs.content]


class TextLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class TextChoice(_Choice):
    text: str
    logprobs: TextLogprobs | None = None

    def output_text(self) -> str:
        return self.text

    def token_logprobs(self) -> list[float]:
        if self.logprobs is None:
            raise ValueError("the choice has no logprobs (ask with logprobs: 0)")
        return self.logprobs.token_logprobs


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage
    prompt_token_ids: list[int]
    """Extension: the prompt as the server tokenized it (chat template applied)."""


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class TextCompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    """OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}

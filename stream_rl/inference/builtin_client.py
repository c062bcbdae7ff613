"""Clients of inference servers: one per engine, every one returning `Completion`s.
`stream_rl.inference.clients.make_client` picks a server's by its engine:

    async with make_client("builtin", "http://127.0.0.1:8100") as client:
        c = await client.complete([4, 9, 13], SamplingConfig(max_tokens=8))
        c.token_ids, c.logprobs, c.version_spans, c.finish_reason

A prompt given as token ids is used as it is; a prompt given as chat messages is rendered by the
server (its chat template). Each engine's client maps that engine's own response fields into
`Completion` (`stream_rl/inference/completion.py`): the built-in server's here, vLLM's in
`vllm_client.py`, SGLang's in `sglang_client.py`. The README's engine table says which fields.

Errors (retries are the caller's, `stream_rl/stages/routing.py`):
- `BadRequestError`: the server refused the request as invalid (400, 413, 422), with its message.
- `ServerBusy`: the engine said "not now, retry" (`BUSY_STATUSES` of its client: vLLM's 503
  while paused for a weight update in `wait` mode, or while its queue is full).
- `InferenceError`: anything else: unreachable, a timeout, another non-2xx status, or a 200 whose
  body is not what the engine's API promises (the message quotes the body's first bytes).
`health()` accepts any 200 (vLLM and SGLang answer with an empty body).
With `api_key`, every call carries `Authorization: Bearer <api_key>` (the servers' `/v1/*` need it).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Protocol, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from stream_rl.config import SamplingConfig
from stream_rl.errors import BadRequestError, InferenceError, ServerBusy
from stream_rl.inference.completion import Completion

Messages = list[dict[str, Any]]
Prompt = list[int] | Messages
M = TypeVar("M", bound=BaseModel)

REQUEST_FAULTS = (400, 413, 422)
"""Statuses that blame the request, not the server."""
_QUOTE = 200  # bytes of an unexpected body quoted in errors


def quote(body: bytes | str) -> str:
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    return repr(text[:_QUOTE]) + ("..." if len(text) > _QUOTE else "")


class CompletionClient(Protocol):
    """The contract of one inference server's client, as the actor holds it
    (`stream_rl.stages.routing.Server.client`, `ClientFactory`) and samples with it
    (`stream_rl.stages.rollouts`): every engine's client below (`InferenceClient`'s subclasses,
    made by `stream_rl.inference.clients.make_client`) implements it, and so does a unit test's
    fake. Errors as the module docstring says."""

    async def complete_many(
        self, prompt: Prompt, sampling: SamplingConfig, *, n: int = 1, seed: int | None = None
    ) -> list[Completion]:
        """n samples of one prompt in one request."""
        ...

    async def complete(
        self, prompt: Prompt, sampling: SamplingConfig, *, seed: int | None = None
    ) -> Completion:
        """One sample of one prompt (token ids or chat messages)."""
        ...

    async def health(self) -> None:
        """Returns if the server is up; InferenceError otherwise."""
        ...

    async def version(self) -> int | None:
        """The weight version the server holds now (None: unknown)."""
        ...

    async def aclose(self) -> None:
        """Release the connections (the pool calls it when a server leaves and at the end)."""
        ...


def is_chat(prompt: Prompt) -> bool:
    if not prompt:
        raise InferenceError("the prompt is empty")
    return isinstance(prompt[0], dict)


class InferenceClient:
    """HTTP plumbing shared by the engines' clients; subclasses implement `complete_many` and
    `version`."""

    engine: ClassVar[str] = "engine"
    BUSY_STATUSES: ClassVar[tuple[int, ...]] = ()
    """Statuses by which this engine says "not now, retry" (raised as `ServerBusy`)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 120.0,
        http: httpx.AsyncClient | None = None,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._own = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=256))

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own:
            await self._http.aclose()

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One call; the decoded JSON answer (None for an empty 2xx body). Raises as the module
        docstring says."""
        url = f"{self.base_url}{path}"
        try:
            response = await self._http.request(method, url, json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise InferenceError(f"{method} {url} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 300:
            message = _error_message(response)
            if response.status_code in REQUEST_FAULTS:
                raise BadRequestError(
                    f"{method} {url}: HTTP {response.status_code}: {message}", response.status_code
                )
            if response.status_code in self.BUSY_STATUSES:
                raise ServerBusy(f"{method} {url}: HTTP {response.status_code}: {message}")
            raise InferenceError(f"{method} {url}: HTTP {response.status_code}: {message}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise InferenceError(
                f"{method} {url}: the answer is not JSON: {quote(response.content)}"
            ) from exc

    def parse(self, model: type[M], data: Any, path: str) -> M:
        """`data` as `model`; a mismatch is the server's fault (InferenceError quoting the body)."""
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InferenceError(
                f"{self.base_url}{path}: unexpected {self.engine} answer ({where}: {first['msg']}): "
                f"{quote(json.dumps(data))}"
            ) from exc

    async def complete_many(
        self, prompt: Prompt, sampling: SamplingConfig, *, n: int = 1, seed: int | None = None
    ) -> list[Completion]:
        """n samples of one prompt in one request (the server prefills the prompt once)."""
        raise NotImplementedError

    async def complete(
        self, prompt: Prompt, sampling: SamplingConfig, *, seed: int | None = None
    ) -> Completion:
        """One sample of one prompt (token ids or chat messages)."""
        return (await self.complete_many(prompt, sampling, n=1, seed=seed))[0]

    async def health(self) -> None:
        """Returns if the server answers `GET /health` with 200; InferenceError otherwise."""
        await self.call("GET", "/health")

    async def version(self) -> int | None:
        """The weight version the server holds now (None: unknown)."""
        raise NotImplementedError


def _error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-style (`{"error": {"message"}}`), vLLM or FastAPI error body."""
    try:
        data = response.json()
    except ValueError:
        return quote(response.content)
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if error is not None:
            return str(error)
    return quote(response.content)


class BuiltinClient(InferenceClient):
    """The built-in server (`stream-rl serve`): OpenAI routes with `token_ids`, `version_spans`
    and `prompt_token_ids` (typed by `stream_rl.inference.protocol`)."""

    engine = "builtin"

    async def complete_many(
        self, prompt: Prompt, sampling: SamplingConfig, *, n: int = 1, seed: int | None = None
    ) -> list[Completion]:
        from stream_rl.inference.protocol import ChatCompletionResponse, TextCompletionResponse

        body: dict[str, Any] = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "max_tokens": sampling.max_tokens,
            "n": n,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if seed is not None:
            body["seed"] = seed
        response: ChatCompletionResponse | TextCompletionResponse
        if is_chat(prompt):
            path = "/v1/chat/completions"
            data = await self.call("POST", path, {**body, "messages": prompt, "logprobs": True})
            response = self.parse(ChatCompletionResponse, data, path)
        else:
            path = "/v1/completions"
            data = await self.call("POST", path, {**body, "prompt": prompt, "logprobs": 0})
            response = self.parse(TextCompletionResponse, data, path)
        out = []
        for choice in sorted(response.choices, key=lambda c: c.index):
            out.append(
                Completion(
                    prompt_token_ids=response.prompt_token_ids,
                    token_ids=choice.token_ids,
                    logprobs=choice.token_logprobs(),
                    version_spans=[s.span() for s in choice.version_spans],
                    text=choice.output_text(),
                    finish_reason=choice.finish_reason,
                )
            )
        if len(out) != n:
            raise InferenceError(f"{self.base_url}{path}: {len(out)} choices for n={n}")
        return out

    async def version(self) -> int | None:
        data = await self.call("GET", "/v1/models")
        try:
            return int(data["data"][0]["version"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise InferenceError(
                f"{self.base_url}/v1/models: no version in {quote(json.dumps(data))}"
            ) from exc

"""A small async client of one inference server (what the actor calls).

    async with InferenceClient("http://127.0.0.1:8100") as client:
        c = await client.complete([4, 9, 13], SamplingConfig(max_tokens=8))
        c.token_ids, c.logprobs, c.version_spans, c.finish_reason

A prompt given as token ids goes to `/v1/completions` (ids used as they are); a prompt given as
chat messages goes to `/v1/chat/completions` (the server applies the chat template). Either way
the result carries the prompt's token ids, the completion's ids and logprobs, and the version
spans. Failures raise InferenceError with the server's message; retries are the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from stream_rl.config import SamplingConfig
from stream_rl.errors import InferenceError
from stream_rl.inference.sequence import VersionSpan

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version_spans: list[VersionSpan]
    text: str
    finish_reason: str


class InferenceClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 120.0,
        admin_token: str | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._own = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=256))
        self._admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own:
            await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        url = f"{self.base_url}{path}"
        try:
            response = await self._http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise InferenceError(f"{method} {url} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            raise InferenceError(f"{method} {url}: HTTP {response.status_code}: {message}")
        return response.json()

    async def complete_many(
        self,
        prompt: list[int] | Messages,
        sampling: SamplingConfig,
        *,
        n: int = 1,
        seed: int | None = None,
    ) -> list[Completion]:
        """n samples of one prompt (the server prefills the prompt once)."""
        if not prompt:
            raise InferenceError("the prompt is empty")
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
        chat = isinstance(prompt[0], dict)
        if chat:
            data = await self._call(
                "POST", "/v1/chat/completions", json={**body, "messages": prompt, "logprobs": True}
            )
        else:
            data = await self._call("POST", "/v1/completions", json={**body, "prompt": prompt, "logprobs": 0})
        out = []
        for choice in sorted(data["choices"], key=lambda c: c["index"]):
            if chat:
                text = choice["message"]["content"] or ""
                logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            else:
                text = choice["text"]
                logprobs = choice["logprobs"]["token_logprobs"]
            out.append(
                Completion(
                    prompt_token_ids=data["prompt_token_ids"],
                    token_ids=choice["token_ids"],
                    logprobs=logprobs,
                    version_spans=[VersionSpan(s["version"], s["start"]) for s in choice["version_spans"]],
                    text=text,
                    finish_reason=choice["finish_reason"],
                )
            )
        return out

    async def complete(
        self, prompt: list[int] | Messages, sampling: SamplingConfig, *, seed: int | None = None
    ) -> Completion:
        """One sample of one prompt (token ids or chat messages)."""
        return (await self.complete_many(prompt, sampling, n=1, seed=seed))[0]

    async def health(self) -> dict[str, Any]:
        """`{"status": "ok", "version": v}`; InferenceError when the server is down or unhealthy."""
        result: dict[str, Any] = await self._call("GET", "/health")
        return result

    async def version(self) -> int:
        """The weight version in force (needs the admin token when the server has one)."""
        data = await self._call("GET", "/weights/version", headers=self._admin)
        return int(data["version"])

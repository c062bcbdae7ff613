"""Hand-written fakes of the inference side, for actor tests that need no model.

`FakeServer` is one server's state (weight version, up/down, calls in flight); `FakeClient`
speaks the `stream_rl.inference.builtin_client.InferenceClient` interface the actor uses: `complete(prompt,
sampling, seed=)` / `complete_many(...)` where prompt is chat messages (single-turn) or token ids
(multi-turn turns), returning real `Completion`s; `health()`, `version()`, `aclose()`. Tokens are characters: id = ord(char); END (id 3) ends a reply.

The policy is a deterministic function of the request seed: arithmetic prompts (`a+b=`) get the
right sum when `seed % 3 != 0`, else a wrong one; token prompts (guessing turns) get a guess.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from stream_rl.config import SamplingConfig
from stream_rl.contracts import ChatMessage, VersionSpan
from stream_rl.errors import BadRequestError, InferenceError, ServerBusy
from stream_rl.inference.completion import Completion

END = 3
ROLE = {"system": 4, "user": 5, "assistant": 6}


def render(
    messages: list[dict[str, str]] | list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """The fake chat template: <role> content <END> per message, then <assistant>."""
    ids: list[int] = []
    for m in messages:
        role, content = (m["role"], m["content"]) if isinstance(m, dict) else (m.role, m.content)
        ids += [ROLE[role], *map(ord, content), END]
    return ids + [ROLE["assistant"]] if add_generation_prompt else ids


class FakeTokenizer:
    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        return render(messages, add_generation_prompt)

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t > 31)


def arithmetic_reply(content: str, seed: int | None) -> str:
    m = re.fullmatch(r"(\d+)([+*-])(\d+)=", content.strip())
    if m is None:
        return "?"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    value = a + b if op == "+" else a - b if op == "-" else a * b
    if seed is not None and seed % 3 == 0:
        value += 1
    return str(value)


@dataclass
class FakeServer:
    url: str
    version: int = 0
    latency_s: float = 0.0
    down: bool = False
    reject: set[str] = field(default_factory=set)
    """Prompts (user content) this server refuses as invalid while up (HTTP 400, BadRequestError)."""
    crash: set[str] = field(default_factory=set)
    """Prompts (user content) this server fails on while up (HTTP 500, InferenceError)."""
    busy: int = 0
    """Calls still to be answered "busy, retry" (ServerBusy, vLLM 0.33's 503 while paused)."""
    calls: int = 0
    failures: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    seeds: list[int | None] = field(default_factory=list)
    gate: asyncio.Event | None = None
    """When set (by a test), calls wait for it: keeps requests in flight."""

    def client(self) -> FakeClient:
        return FakeClient(self)


class FakeClient:
    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.base_url = server.url

    async def complete(
        self, prompt: list[int] | list[dict[str, Any]], sampling: SamplingConfig, *, seed: int | None = None
    ) -> Completion:
        return (await self.complete_many(prompt, sampling, n=1, seed=seed))[0]

    async def complete_many(
        self,
        prompt: list[int] | list[dict[str, Any]],
        sampling: SamplingConfig,
        *,
        n: int = 1,
        seed: int | None = None,
    ) -> list[Completion]:
        """One request for n sequences (sequence i of a seeded request uses seed * 1000003 + i,
        as the real engine derives them)."""
        s = self.server
        s.calls += 1
        if s.down:
            s.failures += 1
            raise InferenceError(f"POST {s.url}/v1/chat/completions failed: ConnectError: refused")
        if s.busy > 0:
            s.busy -= 1
            raise ServerBusy(f"POST {s.url}/inference/v1/generate: HTTP 503: Generation is paused.")
        s.in_flight += 1
        s.max_in_flight = max(s.max_in_flight, s.in_flight)
        try:
            if s.gate is not None:
                await s.gate.wait()
            if s.latency_s:
                await asyncio.sleep(s.latency_s)
            else:
                await asyncio.sleep(0)
            if s.down:
                s.failures += 1
                raise InferenceError(f"POST {s.url}: ReadError: connection reset")
        finally:
            s.in_flight -= 1
        s.seeds.append(seed)
        content = str(prompt[-1]["content"]) if prompt and isinstance(prompt[0], dict) else None  # type: ignore[index]
        if content in s.reject:
            s.failures += 1
            raise BadRequestError(f"POST {s.url}: HTTP 400: prompt rejected")
        if content in s.crash:
            s.failures += 1
            raise InferenceError(f"POST {s.url}: HTTP 500: the engine failed on this prompt")
        out = []
        for i in range(n):
            sub_seed = seed if (seed is None or n == 1) else seed * 1_000_003 + i
            out.append(self._one(prompt, sub_seed))
        return out

    def _one(self, prompt: list[int] | list[dict[str, Any]], seed: int | None) -> Completion:
        s = self.server
        if prompt and isinstance(prompt[0], dict):
            content = str(prompt[-1]["content"])  # type: ignore[index]
            prompt_ids = render(prompt)  # type: ignore[arg-type]
            text = arithmetic_reply(content, seed)
        else:
            prompt_ids = list(prompt)  # type: ignore[arg-type]
            text = f"<answer>{(seed or 0) % 7 + 1 + len(prompt_ids) % 5}</answer>"
        ids = [*map(ord, text), END]
        n = len(ids)
        return Completion(
            prompt_token_ids=prompt_ids,
            token_ids=ids,
            logprobs=[-0.25 - 0.01 * i for i in range(n)],
            version_spans=[VersionSpan(s.version, 0)],
            text=text,
            finish_reason="stop",
        )

    async def health(self) -> None:
        if self.server.down:
            raise InferenceError(f"GET {self.server.url}/health failed: ConnectError: refused")

    async def version(self) -> int | None:
        if self.server.down:
            raise InferenceError(f"GET {self.server.url}/v1/models failed: ConnectError: refused")
        return self.server.version

    async def aclose(self) -> None:
        return None


def factory(servers: list[FakeServer]) -> Any:
    """A client factory for `actor.run(client_factory=...)`: url -> client of that fake server."""
    by_url = {s.url: s for s in servers}

    def make(url: str) -> FakeClient:
        return by_url[url].client()

    return make

"""What a request asks of the engine (`SamplingParams`) and what it gets back (`SequenceResult`,
`RequestResult`): plain types without torch, so a process that only talks to servers (the actor's
client) does not import it. A running sequence is `stream_rl.inference.running_sequence`.

Result contract (per sequence):
- `token_ids` are every sampled token, including the eos token that ended the sequence and
  the token that completed a stop string (the trainer needs the tokens that were sampled).
- `logprobs[j]` is `log_softmax(logits / T)[token_ids[j]]` (T = 1 when greedy), see sampling.py.
- `text` is the decoded completion without special tokens; when a stop string ended the
  sequence the text stops right before it (OpenAI behaviour), while `token_ids` still hold
  the tokens that spelled it.
- `version_spans` list `(version, start)`: tokens from index `start` on were sampled with
  weights `version`, until the next span.
- `finish_reason` is `stop` (eos or a stop string) or `length` (max_tokens or the model's
  maximum length).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Literal

from stream_rl.contracts.core import VersionSpan
from stream_rl.errors import InferenceError

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options of one request (the engine's own type; the server maps OpenAI fields)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0

    def validate(self) -> None:
        """Raise InferenceError naming the first invalid option."""
        if not self.temperature >= 0:
            raise InferenceError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InferenceError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InferenceError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise InferenceError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise InferenceError(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            raise InferenceError("stop strings must not be empty")
        if not 0 <= self.top_logprobs <= 20:
            raise InferenceError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")


@dataclass
class SequenceResult:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    version_spans: list[VersionSpan]
    text: str
    finish_reason: FinishReason
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class RequestResult:
    prompt_token_ids: list[int]
    sequences: list[SequenceResult]


@dataclass(eq=False)  # compared and hashed by identity
class Request:
    prompt: list[int]
    params: SamplingParams
    future: concurrent.futures.Future[RequestResult]
    arrival: float = field(default_factory=time.monotonic)
    results: list[SequenceResult | None] = field(default_factory=list)

    def finish_sequence(self, result: SequenceResult) -> bool:
        """Record one finished sequence; resolve the future once all n are done (then True)."""
        self.results[result.index] = result
        if any(r is None for r in self.results) or self.future.done():
            return False
        self.future.set_result(RequestResult(self.prompt, [r for r in self.results if r is not None]))
        return True

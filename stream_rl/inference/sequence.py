"""What a request asks of the engine, what it gets back, and one sequence's running state.

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
from typing import Any, Literal

import torch
from tokenizers.decoders import DecodeStream

from stream_rl.contracts.core import VersionSpan
from stream_rl.errors import InferenceError

FinishReason = Literal["stop", "length"]
_SEED_STRIDE = 1_000_003  # distinct seeds for the n sequences of one seeded request


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


class Sequence:
    """One running sequence: its tokens, logprobs, spans, cache length and stop detection."""

    def __init__(self, request: Request, index: int, device: torch.device, tokenizer: Any) -> None:
        self.request = request
        self.index = index
        params = request.params
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            seed = (params.seed * _SEED_STRIDE + index) % 2**63
            self.generator = torch.Generator(device=device).manual_seed(seed)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] | None = [] if params.top_logprobs else None
        self.spans: list[VersionSpan] = []
        self.cache_len = 0  # positions held in the KV cache (prompt + tokens fed back so far)
        self.finish_reason: FinishReason | None = None
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True) if params.stop else None
        self._text = ""
        self._cut: int | None = None
        self._max_stop = max((len(s) for s in params.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def all_tokens(self) -> list[int]:
        return self.request.prompt + self.tokens

    def append(
        self,
        token: int,
        logprob: float,
        version: int,
        eos_ids: frozenset[int],
        max_len: int,
        top: list[tuple[int, float]] | None = None,
    ) -> None:
        """Record a sampled token and decide whether the sequence is finished."""
        if not self.spans or self.spans[-1].version != version:
            self.spans.append(VersionSpan(version, len(self.tokens)))
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.top is not None and top is not None:
            self.top.append(top)
        params = self.request.params
        ended = token in eos_ids and not params.ignore_eos
        if ended or (self._stream is not None and self._stop_string_hit(token)):
            self.finish_reason = "stop"
        elif len(self.tokens) >= params.max_tokens or len(self.request.prompt) + len(self.tokens) >= max_len:
            self.finish_reason = "length"

    def _stop_string_hit(self, token: int) -> bool:
        assert self._stream is not None
        piece = self._stream.step(self._tokenizer.backend_tokenizer, token)
        if not piece:
            return False
        start = max(0, len(self._text) - self._max_stop + 1)
        self._text += piece
        hits = [i for i in (self._text.find(s, start) for s in self.request.params.stop) if i >= 0]
        if hits:
            self._cut = min(hits)
            return True
        return False

    def result(self) -> SequenceResult:
        assert self.finish_reason is not None
        if self._stream is not None:
            text = self._text if self._cut is None else self._text[: self._cut]
        else:
            text = self._tokenizer.decode(self.tokens, skip_special_tokens=True)
        return SequenceResult(
            index=self.index,
            token_ids=self.tokens,
            logprobs=self.logprobs,
            version_spans=self.spans,
            text=text,
            finish_reason=self.finish_reason,
            top_logprobs=self.top,
        )

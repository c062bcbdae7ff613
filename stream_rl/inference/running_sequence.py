"""One running sequence's state: its tokens, logprobs, version spans, cache length and stop
detection (the request and result types it fills are `stream_rl.inference.requests`)."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers.decoders import DecodeStream

from stream_rl.contracts.core import VersionSpan
from stream_rl.inference.requests import FinishReason, Request, SequenceResult

_SEED_STRIDE = 1_000_003  # distinct seeds for the n sequences of one seeded request


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

"""What every contract shares: the record protocol, enums, version spans, validation helpers."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Protocol, Self

from stream_rl.errors import ContractError


def now_ms() -> int:
    return int(time.time() * 1000)


class Verdict(StrEnum):
    CORRECT = "correct"
    WRONG = "wrong"
    NO_ANSWER = "no_answer"
    UNPARSABLE = "unparsable"
    ERROR = "error"
    TIMEOUT = "timeout"


class WeightVersionKind(StrEnum):
    INIT = "init"
    UPDATE = "update"
    FINAL = "final"


class Contract(Protocol):
    SCHEMA: ClassVar[str]

    def to_dict(self) -> dict[str, Any]: ...

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self: ...

    def validate(self) -> None: ...


def require(cond: bool, what: str) -> None:
    if not cond:
        raise ContractError(what)


VALUE_LIMIT = 1e9
"""Largest magnitude a reward or an advantage may have: larger finite values overflow sums
(a group's mean, a loss) long before they mean anything."""


def require_finite(value: float, what: str, limit: float = VALUE_LIMIT) -> None:
    """`value` is a finite number of magnitude at most `limit`."""
    require(
        math.isfinite(value) and abs(value) <= limit,
        f"{what} is {value!r} (must be finite, |x| <= {limit:g})",
    )


def require_all_finite(values: Iterable[float], what: str, limit: float = VALUE_LIMIT) -> None:
    for i, v in enumerate(values):
        if not (math.isfinite(v) and abs(v) <= limit):
            raise ContractError(f"{what}[{i}] is {v!r} (must be finite, |x| <= {limit:g})")


def require_logprobs(values: Iterable[float], what: str) -> None:
    """Log-probabilities: finite and <= 0."""
    for i, v in enumerate(values):
        if not (math.isfinite(v) and v <= 0.0):
            raise ContractError(f"{what}[{i}] is {v!r} (a logprob must be finite and <= 0)")


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChatMessage:
        return cls(role=d["role"], content=d["content"])


INCOMPLETE = "stream-rl-incomplete"
"""The weight label of a server whose weights no version describes (an update that did not
finish), until the next update labels them; set by the trainer's senders
(`stream_rl.weights.adapters`) and the vLLM guard, refused by our clients."""


@dataclass(slots=True)
class VersionSpan:
    """Completion tokens from index `start` on (until the next span) came from weights `version`."""

    version: int
    start: int

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "start": self.start}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VersionSpan:
        return cls(version=d["version"], start=d["start"])


def validate_spans(spans: list[VersionSpan], length: int, what: str) -> None:
    """Spans start at 0 (when there are tokens) and strictly increase in start. Versions normally
    increase along a sequence, but may go down: a trainer restarted from a checkpoint re-installs
    its (older, bit-identical) version on the servers while sequences are decoding."""
    require(all(s.version >= 0 for s in spans), f"{what}: a version span carries a negative version")
    if length == 0:
        require(all(s.start == 0 for s in spans), f"{what}: spans on an empty completion must start at 0")
        return
    require(bool(spans), f"{what}: version_spans is empty for {length} tokens")
    require(spans[0].start == 0, f"{what}: first version span must start at 0")
    for a, b in zip(spans, spans[1:], strict=False):
        require(b.start > a.start, f"{what}: version span starts must increase")
        require(b.version != a.version, f"{what}: consecutive version spans carry the same version")
    require(spans[-1].start < length, f"{what}: version span starts past the end")


def token_versions(spans: list[VersionSpan], length: int) -> list[int]:
    """The version of each of `length` tokens."""
    out: list[int] = []
    for i, span in enumerate(spans):
        end = spans[i + 1].start if i + 1 < len(spans) else length
        out.extend([span.version] * (end - span.start))
    return out

"""Typed Python classes for the Avro contracts in `schemas/*.avsc` (namespace `stream_rl.v1`).

Each class maps one record with explicit `to_dict()` / `from_dict()` adapters; stages build
these objects, never wire dicts. `validate()` checks what Avro cannot (aligned array lengths,
ordered version spans); the serde calls it on both sides, so an invalid record never reaches
a stage: it goes to the DLQ instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
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


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ContractError(what)


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChatMessage:
        return cls(role=d["role"], content=d["content"])


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
    if length == 0:
        _require(all(s.start == 0 for s in spans), f"{what}: spans on an empty completion must start at 0")
        return
    _require(bool(spans), f"{what}: version_spans is empty for {length} tokens")
    _require(spans[0].start == 0, f"{what}: first version span must start at 0")
    for a, b in zip(spans, spans[1:], strict=False):
        _require(b.start > a.start, f"{what}: version span starts must increase")
        _require(b.version != a.version, f"{what}: consecutive version spans carry the same version")
    _require(spans[-1].start < length, f"{what}: version span starts past the end")


def token_versions(spans: list[VersionSpan], length: int) -> list[int]:
    """The version of each of `length` tokens."""
    out: list[int] = []
    for i, span in enumerate(spans):
        end = spans[i + 1].start if i + 1 < len(spans) else length
        out.extend([span.version] * (end - span.start))
    return out


@dataclass(slots=True)
class Problem:
    SCHEMA: ClassVar[str] = "Problem"
    run_id: str
    problem_id: str
    epoch: int
    task: str
    prompt: list[ChatMessage]
    answer: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    created_ms: int = field(default_factory=now_ms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "problem_id": self.problem_id,
            "epoch": self.epoch,
            "task": self.task,
            "prompt": [m.to_dict() for m in self.prompt],
            "answer": self.answer,
            "metadata": dict(self.metadata),
            "created_ms": self.created_ms,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Problem:
        return cls(
            run_id=d["run_id"],
            problem_id=d["problem_id"],
            epoch=d["epoch"],
            task=d["task"],
            prompt=[ChatMessage.from_dict(m) for m in d["prompt"]],
            answer=d.get("answer"),
            metadata=dict(d.get("metadata") or {}),
            created_ms=d["created_ms"],
        )

    def validate(self) -> None:
        _require(bool(self.problem_id), "Problem.problem_id is empty")
        _require(self.epoch >= 0, "Problem.epoch is negative")
        _require(bool(self.prompt), f"Problem {self.problem_id}: prompt is empty")


@dataclass(slots=True)
class Rollout:
    SCHEMA: ClassVar[str] = "Rollout"
    rollout_id: str
    group_id: str
    sample_index: int
    group_size: int
    problem: Problem
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    version_spans: list[VersionSpan]
    finish_reason: str
    text: str
    actor_id: str
    server_id: str
    started_ms: int
    finished_ms: int
    generation_ms: float
    completion_mask: list[bool] | None = None
    num_turns: int = 1

    @staticmethod
    def make_group_id(problem: Problem) -> str:
        return f"{problem.problem_id}.e{problem.epoch}"

    @staticmethod
    def make_rollout_id(group_id: str, sample_index: int) -> str:
        return f"{group_id}.s{sample_index}"

    def sampled_mask(self) -> list[bool]:
        """Per completion token: was it sampled by the model (trainable)?"""
        if self.completion_mask is None:
            return [True] * len(self.completion_token_ids)
        return list(self.completion_mask)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "group_size": self.group_size,
            "problem": self.problem.to_dict(),
            "prompt_token_ids": list(self.prompt_token_ids),
            "completion_token_ids": list(self.completion_token_ids),
            "completion_mask": None if self.completion_mask is None else list(self.completion_mask),
            "logprobs": list(self.logprobs),
            "version_spans": [s.to_dict() for s in self.version_spans],
            "finish_reason": self.finish_reason,
            "text": self.text,
            "num_turns": self.num_turns,
            "actor_id": self.actor_id,
            "server_id": self.server_id,
            "started_ms": self.started_ms,
            "finished_ms": self.finished_ms,
            "generation_ms": self.generation_ms,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rollout:
        return cls(
            rollout_id=d["rollout_id"],
            group_id=d["group_id"],
            sample_index=d["sample_index"],
            group_size=d["group_size"],
            problem=Problem.from_dict(d["problem"]),
            prompt_token_ids=list(d["prompt_token_ids"]),
            completion_token_ids=list(d["completion_token_ids"]),
            completion_mask=None if d.get("completion_mask") is None else list(d["completion_mask"]),
            logprobs=list(d["logprobs"]),
            version_spans=[VersionSpan.from_dict(s) for s in d["version_spans"]],
            finish_reason=d["finish_reason"],
            text=d["text"],
            num_turns=d.get("num_turns", 1),
            actor_id=d["actor_id"],
            server_id=d["server_id"],
            started_ms=d["started_ms"],
            finished_ms=d["finished_ms"],
            generation_ms=d["generation_ms"],
        )

    def validate(self) -> None:
        self.problem.validate()
        what = f"Rollout {self.rollout_id}"
        n = len(self.completion_token_ids)
        _require(0 <= self.sample_index < self.group_size, f"{what}: sample_index outside [0, group_size)")
        _require(len(self.logprobs) == n, f"{what}: {len(self.logprobs)} logprobs for {n} completion tokens")
        if self.completion_mask is not None:
            _require(len(self.completion_mask) == n, f"{what}: completion_mask length != completion length")
        _require(bool(self.prompt_token_ids), f"{what}: prompt_token_ids is empty")
        validate_spans(self.version_spans, n, what)


@dataclass(slots=True)
class ScoredRollout:
    SCHEMA: ClassVar[str] = "ScoredRollout"
    rollout: Rollout
    reward: float
    verdict: Verdict
    verifier_id: str
    detail: str = ""
    scored_ms: int = field(default_factory=now_ms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rollout": self.rollout.to_dict(),
            "reward": self.reward,
            "verdict": self.verdict.value,
            "detail": self.detail,
            "verifier_id": self.verifier_id,
            "scored_ms": self.scored_ms,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScoredRollout:
        return cls(
            rollout=Rollout.from_dict(d["rollout"]),
            reward=d["reward"],
            verdict=Verdict(d["verdict"]),
            detail=d.get("detail", ""),
            verifier_id=d["verifier_id"],
            scored_ms=d["scored_ms"],
        )

    def validate(self) -> None:
        self.rollout.validate()
        _require(self.reward == self.reward, f"ScoredRollout {self.rollout.rollout_id}: reward is NaN")


@dataclass(slots=True)
class TrainingSample:
    """One sequence; per-token arrays are aligned with the completion, `input_ids[prompt_len:]`."""

    rollout_id: str
    group_id: str
    input_ids: list[int]
    prompt_len: int
    loss_mask: list[bool]
    advantages: list[float]
    behaviour_logprobs: list[float]
    version_spans: list[VersionSpan]
    reward: float
    verdict: Verdict
    finish_reason: str

    @property
    def completion_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    def to_dict(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "group_id": self.group_id,
            "input_ids": list(self.input_ids),
            "prompt_len": self.prompt_len,
            "loss_mask": list(self.loss_mask),
            "advantages": list(self.advantages),
            "behaviour_logprobs": list(self.behaviour_logprobs),
            "version_spans": [s.to_dict() for s in self.version_spans],
            "reward": self.reward,
            "verdict": self.verdict.value,
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainingSample:
        return cls(
            rollout_id=d["rollout_id"],
            group_id=d["group_id"],
            input_ids=list(d["input_ids"]),
            prompt_len=d["prompt_len"],
            loss_mask=list(d["loss_mask"]),
            advantages=list(d["advantages"]),
            behaviour_logprobs=list(d["behaviour_logprobs"]),
            version_spans=[VersionSpan.from_dict(s) for s in d["version_spans"]],
            reward=d["reward"],
            verdict=Verdict(d["verdict"]),
            finish_reason=d["finish_reason"],
        )

    def validate(self) -> None:
        what = f"TrainingSample {self.rollout_id}"
        n = self.completion_len
        _require(0 < self.prompt_len <= len(self.input_ids), f"{what}: prompt_len outside the sequence")
        for name in ("loss_mask", "advantages", "behaviour_logprobs"):
            got = len(getattr(self, name))
            _require(got == n, f"{what}: {name} has {got} entries for {n} completion tokens")
        validate_spans(self.version_spans, n, what)


@dataclass(slots=True)
class TrainingBatch:
    SCHEMA: ClassVar[str] = "TrainingBatch"
    batch_id: str
    run_id: str
    samples: list[TrainingSample]
    producer_id: str
    created_ms: int = field(default_factory=now_ms)
    num_filtered: int = 0
    """Zero-advantage samples dropped since the previous batch (consumed, never trained)."""

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.samples)

    @property
    def min_version(self) -> int:
        return min((sp.version for s in self.samples for sp in s.version_spans), default=0)

    @property
    def max_version(self) -> int:
        return max((sp.version for s in self.samples for sp in s.version_spans), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "run_id": self.run_id,
            "samples": [s.to_dict() for s in self.samples],
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "min_version": self.min_version,
            "max_version": self.max_version,
            "num_filtered": self.num_filtered,
            "producer_id": self.producer_id,
            "created_ms": self.created_ms,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainingBatch:
        batch = cls(
            batch_id=d["batch_id"],
            run_id=d["run_id"],
            samples=[TrainingSample.from_dict(s) for s in d["samples"]],
            producer_id=d["producer_id"],
            created_ms=d["created_ms"],
            num_filtered=d.get("num_filtered", 0),
        )
        _require(
            d["num_samples"] == batch.num_samples and d["num_tokens"] == batch.num_tokens,
            f"TrainingBatch {batch.batch_id}: num_samples/num_tokens disagree with its samples",
        )
        return batch

    def validate(self) -> None:
        _require(bool(self.samples) or self.num_filtered > 0, f"TrainingBatch {self.batch_id} has no samples")
        _require(self.num_filtered >= 0, f"TrainingBatch {self.batch_id}: num_filtered is negative")
        for s in self.samples:
            s.validate()


@dataclass(slots=True)
class PartitionOffset:
    topic: str
    partition: int
    offset: int
    """Next offset to consume."""

    def to_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "partition": self.partition, "offset": self.offset}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PartitionOffset:
        return cls(topic=d["topic"], partition=d["partition"], offset=d["offset"])


@dataclass(slots=True)
class WeightVersion:
    SCHEMA: ClassVar[str] = "WeightVersion"
    run_id: str
    version: int
    step: int
    kind: WeightVersionKind
    samples_trained: int
    tokens_trained: int
    checksum: str
    samples_filtered: int = 0
    """Cumulative zero-advantage samples consumed without training."""
    consumed_offsets: list[PartitionOffset] = field(default_factory=list)
    broadcast_ms: float = 0.0
    servers_updated: list[str] = field(default_factory=list)
    servers_failed: list[str] = field(default_factory=list)
    checkpoint_uri: str | None = None
    created_ms: int = field(default_factory=now_ms)
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "version": self.version,
            "step": self.step,
            "kind": self.kind.value,
            "samples_trained": self.samples_trained,
            "tokens_trained": self.tokens_trained,
            "samples_filtered": self.samples_filtered,
            "checksum": self.checksum,
            "consumed_offsets": [o.to_dict() for o in self.consumed_offsets],
            "broadcast_ms": self.broadcast_ms,
            "servers_updated": list(self.servers_updated),
            "servers_failed": list(self.servers_failed),
            "checkpoint_uri": self.checkpoint_uri,
            "created_ms": self.created_ms,
            "metrics": dict(self.metrics),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WeightVersion:
        return cls(
            run_id=d["run_id"],
            version=d["version"],
            step=d["step"],
            kind=WeightVersionKind(d["kind"]),
            samples_trained=d["samples_trained"],
            tokens_trained=d["tokens_trained"],
            samples_filtered=d.get("samples_filtered", 0),
            checksum=d["checksum"],
            consumed_offsets=[PartitionOffset.from_dict(o) for o in d["consumed_offsets"]],
            broadcast_ms=d["broadcast_ms"],
            servers_updated=list(d["servers_updated"]),
            servers_failed=list(d.get("servers_failed") or []),
            checkpoint_uri=d.get("checkpoint_uri"),
            created_ms=d["created_ms"],
            metrics=dict(d.get("metrics") or {}),
        )

    @property
    def samples_consumed(self) -> int:
        """Samples the trainer has taken off the stream: trained or filtered."""
        return self.samples_trained + self.samples_filtered

    def validate(self) -> None:
        _require(self.version >= 0, "WeightVersion.version is negative")
        _require(bool(self.checksum), f"WeightVersion {self.version}: checksum is empty")


@dataclass(slots=True)
class PendingSample:
    """One scored sample of an open group, kept as the bytes consumed from `scored`."""

    rollout_id: str
    offset: int
    record: bytes

    def to_dict(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "offset": self.offset, "record": self.record}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PendingSample:
        return cls(rollout_id=d["rollout_id"], offset=d["offset"], record=bytes(d["record"]))


@dataclass(slots=True)
class PartialGroup:
    """The preprocessor's state of one group (compacted `preprocessor-state`, key = group_id).

    Open: the samples received so far. Closed: the group was emitted or dead-lettered; the
    marker stays (a bounded number per partition) so that late duplicates are dropped.
    """

    SCHEMA: ClassVar[str] = "PartialGroup"
    group_id: str
    partition: int
    closed: bool
    samples: list[PendingSample] = field(default_factory=list)
    first_seen_ms: int = field(default_factory=now_ms)
    updated_ms: int = field(default_factory=now_ms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "partition": self.partition,
            "closed": self.closed,
            "samples": [s.to_dict() for s in self.samples],
            "first_seen_ms": self.first_seen_ms,
            "updated_ms": self.updated_ms,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PartialGroup:
        return cls(
            group_id=d["group_id"],
            partition=d["partition"],
            closed=d["closed"],
            samples=[PendingSample.from_dict(s) for s in d["samples"]],
            first_seen_ms=d["first_seen_ms"],
            updated_ms=d["updated_ms"],
        )

    def validate(self) -> None:
        what = f"PartialGroup {self.group_id}"
        _require(bool(self.group_id), "PartialGroup.group_id is empty")
        _require(self.partition >= 0, f"{what}: partition is negative")
        _require(not (self.closed and self.samples), f"{what}: a closed group holds no samples")
        ids = [s.rollout_id for s in self.samples]
        _require(len(set(ids)) == len(ids), f"{what}: a rollout_id appears twice")


CONTRACTS: dict[str, type[Contract]] = {
    cls.SCHEMA: cls for cls in (Problem, Rollout, ScoredRollout, TrainingBatch, WeightVersion, PartialGroup)
}

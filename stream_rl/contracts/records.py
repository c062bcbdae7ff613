"""The records of the rollout path: problems, rollouts, scored rollouts, training batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from stream_rl.contracts.core import (
    ChatMessage,
    Verdict,
    VersionSpan,
    now_ms,
    require,
    require_all_finite,
    require_finite,
    require_logprobs,
    validate_spans,
)


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
        require(bool(self.problem_id), "Problem.problem_id is empty")
        require(self.epoch >= 0, "Problem.epoch is negative")
        require(bool(self.prompt), f"Problem {self.problem_id}: prompt is empty")


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
    problem_partition: int = -1
    """The partition of `problems` the problem came from (-1: not known)."""

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
            "problem_partition": self.problem_partition,
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
            problem_partition=d.get("problem_partition", -1),
        )

    def validate(self) -> None:
        self.problem.validate()
        what = f"Rollout {self.rollout_id}"
        n = len(self.completion_token_ids)
        require(0 <= self.sample_index < self.group_size, f"{what}: sample_index outside [0, group_size)")
        require(len(self.logprobs) == n, f"{what}: {len(self.logprobs)} logprobs for {n} completion tokens")
        require_logprobs(self.logprobs, f"{what}: logprobs")
        require(
            all(t >= 0 for t in self.prompt_token_ids) and all(t >= 0 for t in self.completion_token_ids),
            f"{what}: a token id is negative",
        )
        require(self.num_turns >= 1, f"{what}: num_turns must be >= 1")
        require_finite(self.generation_ms, f"{what}: generation_ms", limit=1e12)
        require(self.generation_ms >= 0, f"{what}: generation_ms is negative")
        if self.completion_mask is not None:
            require(len(self.completion_mask) == n, f"{what}: completion_mask length != completion length")
        require(bool(self.prompt_token_ids), f"{what}: prompt_token_ids is empty")
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
        require_finite(self.reward, f"ScoredRollout {self.rollout.rollout_id}: reward")


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
    problem_partition: int = -1
    """Its rollout's `problem_partition`."""

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
            "problem_partition": self.problem_partition,
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
            problem_partition=d.get("problem_partition", -1),
        )

    def validate(self) -> None:
        what = f"TrainingSample {self.rollout_id}"
        n = self.completion_len
        require(0 < self.prompt_len <= len(self.input_ids), f"{what}: prompt_len outside the sequence")
        for name in ("loss_mask", "advantages", "behaviour_logprobs"):
            got = len(getattr(self, name))
            require(got == n, f"{what}: {name} has {got} entries for {n} completion tokens")
        require(all(t >= 0 for t in self.input_ids), f"{what}: a token id is negative")
        require_all_finite(self.advantages, f"{what}: advantages")
        require_logprobs(self.behaviour_logprobs, f"{what}: behaviour_logprobs")
        require_finite(self.reward, f"{what}: reward")
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
    filtered_by_partition: dict[int, int] = field(default_factory=dict)
    """`num_filtered` by problem partition (-1: not known)."""

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
            "filtered_by_partition": {str(p): n for p, n in self.filtered_by_partition.items()},
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
            filtered_by_partition={int(p): int(n) for p, n in (d.get("filtered_by_partition") or {}).items()},
        )
        require(
            d["num_samples"] == batch.num_samples and d["num_tokens"] == batch.num_tokens,
            f"TrainingBatch {batch.batch_id}: num_samples/num_tokens disagree with its samples",
        )
        return batch

    def validate(self) -> None:
        require(bool(self.samples) or self.num_filtered > 0, f"TrainingBatch {self.batch_id} has no samples")
        require(self.num_filtered >= 0, f"TrainingBatch {self.batch_id}: num_filtered is negative")
        require(
            not self.filtered_by_partition or sum(self.filtered_by_partition.values()) == self.num_filtered,
            f"TrainingBatch {self.batch_id}: filtered_by_partition does not add up to num_filtered",
        )
        for s in self.samples:
            s.validate()

"""The eval stage's records (`eval-results`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from stream_rl.contracts.core import now_ms, require


@dataclass(slots=True)
class EvalResult:
    """One held-out evaluation of one weight version (see `schemas/EvalResult.avsc`)."""

    SCHEMA: ClassVar[str] = "EvalResult"
    run_id: str
    version: int
    task: str
    split: str
    num_problems: int
    mean_reward: float
    mean_length: float
    verdicts: dict[str, int]
    tokens: int
    off_version_tokens: int
    min_token_version: int
    max_token_version: int
    evaluator_id: str
    pass_at_1: float | None = None
    k: int = 0
    temperature: float = 0.0
    sampled_pass_at_1: float | None = None
    pass_at_k: float | None = None
    greedy_correct: list[str] = field(default_factory=list)
    started_ms: int = field(default_factory=now_ms)
    finished_ms: int = field(default_factory=now_ms)

    @property
    def off_version_token_frac(self) -> float:
        return self.off_version_tokens / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "version": self.version,
            "task": self.task,
            "split": self.split,
            "num_problems": self.num_problems,
            "pass_at_1": self.pass_at_1,
            "k": self.k,
            "temperature": self.temperature,
            "sampled_pass_at_1": self.sampled_pass_at_1,
            "pass_at_k": self.pass_at_k,
            "mean_reward": self.mean_reward,
            "mean_length": self.mean_length,
            "verdicts": dict(self.verdicts),
            "tokens": self.tokens,
            "off_version_tokens": self.off_version_tokens,
            "off_version_token_frac": self.off_version_token_frac,
            "min_token_version": self.min_token_version,
            "max_token_version": self.max_token_version,
            "greedy_correct": list(self.greedy_correct),
            "evaluator_id": self.evaluator_id,
            "started_ms": self.started_ms,
            "finished_ms": self.finished_ms,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        return cls(
            run_id=d["run_id"],
            version=d["version"],
            task=d["task"],
            split=d["split"],
            num_problems=d["num_problems"],
            pass_at_1=d.get("pass_at_1"),
            k=d.get("k", 0),
            temperature=d.get("temperature", 0.0),
            sampled_pass_at_1=d.get("sampled_pass_at_1"),
            pass_at_k=d.get("pass_at_k"),
            mean_reward=d["mean_reward"],
            mean_length=d["mean_length"],
            verdicts={k: int(v) for k, v in d["verdicts"].items()},
            tokens=d["tokens"],
            off_version_tokens=d["off_version_tokens"],
            min_token_version=d["min_token_version"],
            max_token_version=d["max_token_version"],
            greedy_correct=list(d.get("greedy_correct") or []),
            evaluator_id=d["evaluator_id"],
            started_ms=d["started_ms"],
            finished_ms=d["finished_ms"],
        )

    def validate(self) -> None:
        what = f"EvalResult of version {self.version}"
        require(self.version >= 0, f"{what}: version is negative")
        require(self.num_problems > 0, f"{what}: no problems")
        require(
            0 <= self.off_version_tokens <= self.tokens, f"{what}: off_version_tokens outside [0, tokens]"
        )
        for name in ("pass_at_1", "sampled_pass_at_1", "pass_at_k"):
            value = getattr(self, name)
            require(value is None or 0.0 <= value <= 1.0, f"{what}: {name} outside [0, 1]")
        require(self.pass_at_1 is not None or self.k > 0, f"{what}: neither greedy nor sampled")

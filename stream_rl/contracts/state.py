"""The preprocessor's compacted state records (`preprocessor-state`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from stream_rl.contracts.core import now_ms, require


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
        require(bool(self.group_id), "PartialGroup.group_id is empty")
        require(self.partition >= 0, f"{what}: partition is negative")
        require(not (self.closed and self.samples), f"{what}: a closed group holds no samples")
        ids = [s.rollout_id for s in self.samples]
        require(len(set(ids)) == len(ids), f"{what}: a rollout_id appears twice")

"""The trainer's version events (`weight-versions`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from stream_rl.contracts.core import WeightVersionKind, now_ms, require


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
    consumed_by_partition: dict[int, int] = field(default_factory=dict)
    """`samples_consumed` by the problems partition its samples came from (-1: not known)."""

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
            "consumed_by_partition": {str(p): n for p, n in self.consumed_by_partition.items()},
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
            consumed_by_partition={int(p): int(n) for p, n in (d.get("consumed_by_partition") or {}).items()},
        )

    @property
    def samples_consumed(self) -> int:
        """Samples the trainer has taken off the stream: trained or filtered."""
        return self.samples_trained + self.samples_filtered

    @property
    def attributed(self) -> bool:
        """Every consumed sample is counted under a known problems partition
        (`consumed_by_partition`); False for a lineage started before the field existed."""
        by = self.consumed_by_partition
        return by.get(-1, 0) == 0 and sum(by.values()) == self.samples_consumed

    def validate(self) -> None:
        require(self.version >= 0, "WeightVersion.version is negative")
        what = f"WeightVersion {self.version}"
        for name in ("step", "samples_trained", "tokens_trained", "samples_filtered"):
            require(getattr(self, name) >= 0, f"{what}: {name} is negative")
        require(
            math.isfinite(self.broadcast_ms) and self.broadcast_ms >= 0,
            f"{what}: broadcast_ms must be finite, >= 0",
        )
        require(
            all(o.offset >= 0 and o.partition >= 0 for o in self.consumed_offsets), f"{what}: negative offset"
        )
        require(bool(self.checksum), f"WeightVersion {self.version}: checksum is empty")

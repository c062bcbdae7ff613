"""The topology (`topology/topics.yaml`) as code: topic specs, run-namespaced names, `topics apply`.

A run's topics are `<prefix>.<run>.<name>` plus `<prefix>.<run>.<name>.dlq` for every topic with
a DLQ; `_schemas` is shared by the cluster (`<prefix>._schemas`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from stream_rl.config import DEFAULT_PREFIX
from stream_rl.errors import ConfigError
from stream_rl.kafka.serde import Serde, default_serde
from stream_rl.kafka.transport import Transport

if TYPE_CHECKING:
    from stream_rl.kafka.client import KafkaTransport

TOPOLOGY_PATH = Path(__file__).resolve().parents[2] / "topology" / "topics.yaml"

PROBLEMS = "problems"
RAW_ROLLOUTS = "raw-rollouts"
SCORED = "scored"
TRAINING_BATCHES = "training-batches"
WEIGHT_VERSIONS = "weight-versions"
EVAL_RESULTS = "eval-results"
SCHEMAS = "_schemas"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    key: str
    value: str
    producer: str
    consumers: tuple[str, ...]
    followers: tuple[str, ...]
    partitions: int
    retention_ms: int
    cleanup_policy: str
    dlq: bool
    is_global: bool = False
    max_message_bytes: int | None = None

    def configs(self) -> dict[str, str]:
        out = {"retention.ms": str(self.retention_ms), "cleanup.policy": self.cleanup_policy}
        if self.max_message_bytes:
            out["max.message.bytes"] = str(self.max_message_bytes)
        if self.cleanup_policy == "compact":
            out["min.compaction.lag.ms"] = "0"
            out["segment.ms"] = "600000"
        return out


@lru_cache(maxsize=4)
def load_topology(path: Path = TOPOLOGY_PATH) -> dict[str, TopicSpec]:
    data: Any = yaml.safe_load(path.read_text())
    specs: dict[str, TopicSpec] = {}
    for name, t in data["topics"].items():
        specs[name] = TopicSpec(
            name=name,
            key=t["key"],
            value=t["value"],
            producer=t["producer"],
            consumers=tuple(t.get("consumers") or ()),
            followers=tuple(t.get("followers") or ()),
            partitions=int(t["partitions"]),
            retention_ms=int(t["retention_ms"]),
            cleanup_policy=t["cleanup_policy"],
            dlq=bool(t.get("dlq", False)),
            is_global=bool(t.get("global", False)),
            max_message_bytes=t.get("max_message_bytes"),
        )
    return specs


@dataclass(frozen=True)
class TopicNames:
    """Resolves topology names to the full names of one run."""

    run: str
    prefix: str = DEFAULT_PREFIX

    def __getitem__(self, name: str) -> str:
        return self.topic(name)

    def topic(self, name: str) -> str:
        specs = load_topology()
        if name not in specs:
            raise ConfigError(f"unknown topic {name!r}; topology has {sorted(specs)}")
        if specs[name].is_global:
            return f"{self.prefix}.{name}"
        return f"{self.prefix}.{self.run}.{name}"

    def dlq(self, name: str) -> str:
        """The DLQ twin of a topic."""
        return self.topic(name) + ".dlq"

    def group(self, role: str) -> str:
        """Consumer group id of a role in this run (groups are namespaced like topics)."""
        return f"{self.prefix}.{self.run}.{role}"

    def all_topics(self, partitions: int | None = None) -> list[tuple[str, int, dict[str, str]]]:
        """(full name, partitions, configs) of every topic of the run, DLQs and `_schemas` included."""
        out = []
        for spec in load_topology().values():
            # The override applies to the partitioned (scalable) topics only; single-partition
            # topics are single by design (ordering: trainer input, lineage, schemas).
            parts = partitions if (partitions is not None and spec.partitions > 1) else spec.partitions
            out.append((self.topic(spec.name), parts, spec.configs()))
            if spec.dlq:
                out.append((self.dlq(spec.name), 1, {"retention.ms": "-1", "cleanup.policy": "delete"}))
        return out


@dataclass
class ApplyReport:
    created: list[str]
    existing: list[str]
    drift: list[str]
    """Human-readable differences between existing topics and the topology."""


def apply_topics(transport: KafkaTransport, names: TopicNames, partitions: int | None = None) -> ApplyReport:
    """Create the run's topics idempotently and report existing topics whose config differs."""
    wanted = names.all_topics(partitions)
    existing = set(transport.list_topic_names())
    created = transport.create_topics([t for t in wanted if t[0] not in existing])
    present = [t for t in wanted if t[0] in existing]
    drift: list[str] = []
    if present:
        actual = transport.topic_configs([t[0] for t in present])
        for name, parts, conf in present:
            got_parts = len(transport.partitions(name))
            if got_parts != parts:
                drift.append(f"{name}: {got_parts} partitions, topology says {parts}")
            for key, value in conf.items():
                have = actual.get(name, {}).get(key)
                if have is not None and have != value:
                    drift.append(f"{name}: {key}={have}, topology says {value}")
    return ApplyReport(created=created, existing=[t[0] for t in present], drift=drift)


def publish_schemas(transport: Transport, names: TopicNames, serde: Serde | None = None) -> int:
    """Write every current schema to the compacted `_schemas` topic, keyed by fingerprint."""
    serde = serde or default_serde()
    producer = transport.producer("schema-publisher")
    records = serde.schema_records()
    for fp, canonical in records:
        producer.produce(names.topic(SCHEMAS), canonical.encode(), key=fp)
    producer.flush()
    producer.close()
    return len(records)


def topology_markdown() -> str:
    """The topology as a Markdown table (the README embeds it; a test keeps them equal)."""
    rows = [
        "| topic | key | value | producer | consumer groups (followers) | partitions | retention | cleanup | DLQ |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in load_topology().values():
        readers = ", ".join(s.consumers) or "—"
        if s.followers:
            readers += f" ({', '.join(s.followers)})"
        retention = "forever" if s.retention_ms < 0 else f"{s.retention_ms / 86_400_000:g} d"
        rows.append(
            f"| `{s.name}` | {s.key} | `{s.value}` | {s.producer} | {readers} | {s.partitions} | "
            f"{retention} | {s.cleanup_policy} | {'yes' if s.dlq else 'no'} |"
        )
    return "\n".join(rows)

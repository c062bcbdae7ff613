"""The topology (`topology/topics.yaml`) as code: topic specs, run-namespaced names, `topics apply`.

A run's topics are `<prefix>.<run>.<name>` plus `<prefix>.<run>.<name>.dlq` for every topic with
a DLQ; `_schemas` is shared by the cluster (`<prefix>._schemas`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import yaml

from stream_rl.config import DEFAULT_PREFIX
from stream_rl.errors import ConfigError
from stream_rl.kafka.serde import Serde, default_serde
from stream_rl.kafka.transport import Transport

TOPOLOGY_PATH = Path(__file__).resolve().parents[2] / "topology" / "topics.yaml"

PROBLEMS = "problems"
RAW_ROLLOUTS = "raw-rollouts"
SCORED = "scored"
TRAINING_BATCHES = "training-batches"
WEIGHT_VERSIONS = "weight-versions"
EVAL_RESULTS = "eval-results"
SERVERS = "servers"
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
    replication_factor: int = 1
    min_insync_replicas: int = 1

    def configs(self, min_insync_replicas: int | None = None) -> dict[str, str]:
        """The topic's broker configs; `min_insync_replicas` overrides the topology's."""
        out = {
            "retention.ms": str(self.retention_ms),
            "cleanup.policy": self.cleanup_policy,
            "min.insync.replicas": str(min_insync_replicas or self.min_insync_replicas),
        }
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
            replication_factor=int(t.get("replication_factor", 1)),
            min_insync_replicas=int(t.get("min_insync_replicas", 1)),
        )
        spec = specs[name]
        if not 1 <= spec.min_insync_replicas <= spec.replication_factor:
            raise ConfigError(
                f"{path}: topic {name}: min_insync_replicas must be between 1 and replication_factor "
                f"({spec.min_insync_replicas} > {spec.replication_factor})"
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

    def all_topics(
        self, partitions: int | None = None, min_insync_replicas: int | None = None
    ) -> list[tuple[str, int, dict[str, str]]]:
        """(full name, partitions, configs) of every topic of the run, DLQs and `_schemas` included;
        `min_insync_replicas` overrides the topology's for all of them (`kafka.min_insync_replicas`)."""
        out = []
        for spec in load_topology().values():
            # The override applies to the partitioned (scalable) topics only; single-partition
            # topics are single by design (ordering: trainer input, lineage, schemas).
            parts = partitions if (partitions is not None and spec.partitions > 1) else spec.partitions
            out.append((self.topic(spec.name), parts, spec.configs(min_insync_replicas)))
            if spec.dlq:
                isr = str(min_insync_replicas or spec.min_insync_replicas)
                dlq_conf = {"retention.ms": "-1", "cleanup.policy": "delete", "min.insync.replicas": isr}
                out.append((self.dlq(spec.name), 1, dlq_conf))
        return out

    def replication_factors(self, replication_factor: int | None = None) -> dict[str, int]:
        """Full name -> replication factor of every topic of the run (a DLQ has its topic's);
        `replication_factor` overrides the topology's (`kafka.replication_factor`)."""
        out: dict[str, int] = {}
        for spec in load_topology().values():
            out[self.topic(spec.name)] = replication_factor or spec.replication_factor
            if spec.dlq:
                out[self.dlq(spec.name)] = replication_factor or spec.replication_factor
        return out


class TopicAdmin(Protocol):
    """The admin calls `topics apply` needs (KafkaTransport; MemoryTransport in unit tests)."""

    def list_topic_names(self) -> list[str]: ...

    def partitions(self, topic: str) -> list[int]: ...

    def topic_configs(self, topics: list[str]) -> dict[str, dict[str, str]]: ...

    def replication_factor(self, topic: str) -> int: ...

    def broker_count(self) -> int: ...

    def create_topics(
        self,
        topics: list[tuple[str, int, dict[str, str]]],
        replication_factors: Mapping[str, int] | None = None,
    ) -> list[str]: ...


@dataclass
class ApplyReport:
    created: list[str]
    existing: list[str]
    drift: list[str]
    """Human-readable differences between existing topics and the topology."""


def check_replication(names: TopicNames, brokers: int, factor: int | None, min_insync: int | None) -> None:
    """One-line ConfigError unless every topic's replication fits the cluster: no more copies than
    brokers, and min.insync.replicas <= the replication factor (else every acks=all write fails)."""
    factors = names.replication_factors(factor)
    for name, _parts, conf in names.all_topics(min_insync_replicas=min_insync):
        rf, isr = factors[name], int(conf["min.insync.replicas"])
        if rf > brokers:
            raise ConfigError(
                f"topic {name}: replication factor {rf} but the cluster has {brokers} broker(s) "
                "(set kafka.replication_factor to at most the broker count)"
            )
        if isr > rf:
            raise ConfigError(
                f"topic {name}: min.insync.replicas {isr} > replication factor {rf}: every write would "
                "fail (lower kafka.min_insync_replicas or raise kafka.replication_factor)"
            )


def apply_topics(
    transport: TopicAdmin,
    names: TopicNames,
    partitions: int | None = None,
    *,
    replication_factor: int | None = None,
    min_insync_replicas: int | None = None,
) -> ApplyReport:
    """Create the run's topics idempotently and report existing topics whose config differs
    (partitions, replication factor, and every config the topology sets, `min.insync.replicas`
    included). `replication_factor` / `min_insync_replicas` override the topology's for every topic."""
    check_replication(names, transport.broker_count(), replication_factor, min_insync_replicas)
    wanted = names.all_topics(partitions, min_insync_replicas)
    factors = names.replication_factors(replication_factor)
    existing = set(transport.list_topic_names())
    created = transport.create_topics([t for t in wanted if t[0] not in existing], factors)
    present = [t for t in wanted if t[0] in existing]
    drift: list[str] = []
    if present:
        actual = transport.topic_configs([t[0] for t in present])
        for name, parts, conf in present:
            got_parts = len(transport.partitions(name))
            if got_parts != parts:
                drift.append(f"{name}: {got_parts} partitions, topology says {parts}")
            got_rf = transport.replication_factor(name)
            if got_rf != factors[name]:
                drift.append(
                    f"{name}: replication factor {got_rf}, topology says {factors[name]} "
                    "(Kafka changes it only by partition reassignment)"
                )
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
        "| topic | key | value | producer | consumer groups (followers) | partitions | replicas (min ISR) "
        "| retention | cleanup | DLQ |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in load_topology().values():
        readers = ", ".join(s.consumers) or "—"
        if s.followers:
            readers += f" ({', '.join(s.followers)})"
        retention = "forever" if s.retention_ms < 0 else f"{s.retention_ms / 86_400_000:g} d"
        rows.append(
            f"| `{s.name}` | {s.key} | `{s.value}` | {s.producer} | {readers} | {s.partitions} | "
            f"{s.replication_factor} ({s.min_insync_replicas}) | {retention} | {s.cleanup_policy} | {'yes' if s.dlq else 'no'} |"
        )
    return "\n".join(rows)

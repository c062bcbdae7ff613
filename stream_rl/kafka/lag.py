"""Consumer lag: per group, topic and partition, end offset - committed offset, and the age of
the oldest unconsumed record. Divided by samples per optimizer step, broker lag becomes an
expected version lag (docs/operations.md "Monitoring").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from stream_rl.kafka.topics import TopicNames, load_topology
from stream_rl.kafka.transport import Transport


@dataclass(frozen=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    end: int
    committed: int
    """-1 when the group has committed nothing on this partition."""
    lag: int
    oldest_age_s: float | None
    """Age of the oldest unconsumed record; None when nothing is waiting."""


def partition_lags(transport: Transport, group: str, topic: str, with_age: bool = True) -> list[PartitionLag]:
    marks = transport.watermarks(topic)
    committed = transport.group_offsets(group, topic)
    out = []
    for p, (low, high) in sorted(marks.items()):
        c = committed.get(p, -1)
        start = c if c >= 0 else low
        lag = max(high - start, 0)
        age = _oldest_age(transport, topic, p, start) if with_age and lag > 0 else None
        out.append(PartitionLag(group, topic, p, high, c, lag, age))
    return out


def _oldest_age(transport: Transport, topic: str, partition: int, offset: int) -> float | None:
    consumer = transport.consumer(None, "stream-rl-lag")
    try:
        consumer.assign({(topic, partition): offset})
        msgs = consumer.poll_batch(1, 2.0)
    finally:
        consumer.close()
    if not msgs or not msgs[0].timestamp_ms:
        return None
    return max(time.time() - msgs[0].timestamp_ms / 1000.0, 0.0)


def run_lags(transport: Transport, names: TopicNames, with_age: bool = True) -> list[PartitionLag]:
    """Lag of every consumer group of a run on every topic it consumes (per the topology)."""
    out: list[PartitionLag] = []
    for spec in load_topology().values():
        for role in spec.consumers:
            out.extend(partition_lags(transport, names.group(role), names.topic(spec.name), with_age))
    return out


def format_lags(lags: list[PartitionLag]) -> str:
    rows = [("group", "topic", "part", "end", "committed", "lag", "oldest age")]
    for x in lags:
        age = "-" if x.oldest_age_s is None else f"{x.oldest_age_s:.1f}s"
        rows.append(
            (
                x.group,
                x.topic,
                str(x.partition),
                str(x.end),
                str(x.committed) if x.committed >= 0 else "-",
                str(x.lag),
                age,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


class LagExporter:
    """Prometheus gauges of a run's consumer lag (the launcher and `stream-rl lag
    --serve-metrics` refresh them)."""

    def __init__(self, transport: Transport, names: TopicNames) -> None:
        from prometheus_client import Gauge

        self.transport = transport
        self.names = names
        self.lag = _gauge(
            Gauge, "stream_rl_consumer_lag", "End offset - committed offset", ["group", "topic", "partition"]
        )
        self.age = _gauge(
            Gauge,
            "stream_rl_consumer_oldest_record_age_seconds",
            "Age of the oldest unconsumed record",
            ["group", "topic"],
        )

    def refresh(self, with_age: bool = True) -> list[PartitionLag]:
        lags = run_lags(self.transport, self.names, with_age)
        ages: dict[tuple[str, str], float] = {}
        for x in lags:
            self.lag.labels(x.group, x.topic, str(x.partition)).set(x.lag)
            key = (x.group, x.topic)
            ages[key] = max(ages.get(key, 0.0), x.oldest_age_s or 0.0)
        for (group, topic), age in ages.items():
            self.age.labels(group, topic).set(age)
        return lags


def _gauge(cls: Any, name: str, doc: str, labels: list[str]) -> Any:
    """One gauge per process (prometheus_client refuses duplicates in its default registry)."""
    from prometheus_client import REGISTRY

    existing = REGISTRY._names_to_collectors.get(name)  # noqa: SLF001 - no public lookup API
    return existing if existing is not None else cls(name, doc, labels)

"""The real transport: confluent-kafka (librdkafka) producers, consumers and admin calls.

Split by role: `librdkafka` (client properties, construction, error mapping, bounded calls),
`probe` (`check_reachable`), `producer` (`KafkaProducer`), `consumer` (`KafkaConsumer`); this
module composes them into `KafkaTransport` (the client factory and admin calls of one cluster)
and re-exports their public names. Import from `stream_rl.kafka.confluent`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient, NewTopic

from stream_rl.config import KafkaConfig
from stream_rl.errors import KafkaError
from stream_rl.kafka.consumer import STATIC_SESSION_TIMEOUT_MS, KafkaConsumer
from stream_rl.kafka.leaders import LeaderHealth, leaders_of
from stream_rl.kafka.librdkafka import (
    BOUNDED_GRACE_S,
    DEFAULT_COMPRESSION,
    MAX_MESSAGE_BYTES,
    Properties,
    Wedged,
    build_client,
    client_conf,
    fail,
)
from stream_rl.kafka.outage import CLIENT_LOG, DEFAULT_OUTAGE_S, TransientKafkaError, retry
from stream_rl.kafka.probe import check_reachable
from stream_rl.kafka.producer import KafkaProducer

__all__ = [
    "BOUNDED_GRACE_S",
    "DEFAULT_COMPRESSION",
    "MAX_MESSAGE_BYTES",
    "STATIC_SESSION_TIMEOUT_MS",
    "KafkaConsumer",
    "KafkaProducer",
    "KafkaTransport",
    "Properties",
    "Wedged",
    "build_client",
    "check_reachable",
    "client_conf",
]

T = TypeVar("T")

PROPAGATION_S = 30.0
"""How long after this transport created a topic a broker that does not know it yet is waited
for, rather than the topic called missing: KRaft brokers learn a new topic from the metadata log
each at its own pace (librdkafka's `topic.metadata.propagation.max.ms`, same default)."""


class KafkaTransport:
    """Factory of clients for one cluster, plus the admin calls the stages need. Every client it
    builds (producers, consumers, the admin client, offset readers) gets `properties`."""

    @classmethod
    def for_config(cls, kafka: KafkaConfig, bootstrap: str, **kwargs: Any) -> KafkaTransport:
        """The transport of a process whose run config is `kafka`: its client properties (secrets
        read now) on every client. Every process builds its transport here."""
        return cls(bootstrap, properties=kafka.librdkafka_properties(), **kwargs)

    @classmethod
    def for_run(cls, kafka: KafkaConfig, bootstrap: str | None = None) -> KafkaTransport:
        """The transport of any command that reads or writes a run's topics (the stages, replay,
        export, track, rescore): `bootstrap` (a `--bootstrap`), else the config's, else
        `$STREAM_RL_KAFKA_BOOTSTRAP`, else the local broker recorded in `kafka.data_dir`; the
        config's client properties, `outage_timeout_s` and `compression`. Nothing is contacted."""
        from stream_rl.kafka.broker import resolve_bootstrap

        return cls.for_config(
            kafka,
            resolve_bootstrap(bootstrap, kafka.bootstrap, kafka.data_dir),
            outage_s=kafka.outage_timeout_s,
            compression=kafka.compression,
        )

    def __init__(
        self,
        bootstrap: str,
        outage_s: float = DEFAULT_OUTAGE_S,
        compression: str = DEFAULT_COMPRESSION,
        properties: Properties | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.outage_s = outage_s
        """How long calls wait out a broker that does not answer (`kafka.outage_timeout_s`)."""
        self.compression = compression
        self.properties: Properties = dict(properties or {})
        """librdkafka properties of every client this transport builds (`KafkaConfig.librdkafka_properties`)."""
        self._admin: AdminClient | None = None
        self._offset_readers: dict[str, ck.Consumer] = {}
        self._leaders = LeaderHealth()
        self._created: dict[str, float] = {}
        """Topics this transport created, and when (monotonic): see PROPAGATION_S."""

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap, "logger": CLIENT_LOG}
            self._admin = build_client(AdminClient, {**conf, **client_conf(self.properties)})
        return self._admin

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        try:
            return retry(fn, what, self.outage_s, fail)
        finally:
            if self._admin is not None:
                self._admin.poll(0)  # serves its queued log lines (they would pile up otherwise)

    def check_reachable(self, timeout: float | None = None) -> None:
        check_reachable(self.bootstrap, timeout, self.properties)

    def producer(self, client_id: str, transactional_id: str | None = None) -> KafkaProducer:
        return KafkaProducer(
            self.bootstrap,
            client_id,
            transactional_id,
            outage_s=self.outage_s,
            compression=self.compression,
            properties=self.properties,
        )

    def consumer(self, group_id: str | None, client_id: str, instance_id: str | None = None) -> KafkaConsumer:
        extra: dict[str, Any] | None = None
        if instance_id and group_id:
            # A static member that misses its session is fenced on its next commit, a fatal error
            # for librdkafka (the stage dies). A restart under the same id takes over at once, so a
            # long session costs nothing there; a short one killed stages whose process or broker
            # was starved of CPU for 6 s (seen on a 2-core machine with pinned CPUs).
            # The session also outlasts a broker outage (`outage_s`): a static member whose session
            # expires client-side during one rejoins and is fenced by its own new member id, a
            # fatal error (seen: a 30 s broker restart on a loaded machine).
            session_ms = max(STATIC_SESSION_TIMEOUT_MS, int(self.outage_s * 1000))
            extra = {"group.instance.id": instance_id, "session.timeout.ms": session_ms}
        return KafkaConsumer(
            self.bootstrap, group_id, client_id, extra, outage_s=self.outage_s, properties=self.properties
        )

    def partitions(self, topic: str, timeout: float = 10.0) -> list[int]:
        return self._retry(lambda: self._partitions(topic, timeout), f"describe {topic}")

    def _partitions(self, topic: str, timeout: float) -> list[int]:
        return sorted(self._topic_metadata(topic, timeout).topics[topic].partitions)

    def _topic_metadata(self, topic: str, timeout: float) -> Any:
        """The cluster's metadata for `topic` (admin `list_topics`), which must exist."""
        md = self.admin.list_topics(topic=topic, timeout=timeout)
        t = md.topics.get(topic)
        if t is None or (t.error is not None and t.error.code() == ck.KafkaError.UNKNOWN_TOPIC_OR_PART):
            age = time.monotonic() - self._created.get(topic, -PROPAGATION_S)
            if age < PROPAGATION_S:  # the answering broker has not caught up with the controller
                raise TransientKafkaError(
                    f"topic {topic}, created {age:.1f}s ago, not known yet to every broker"
                )
            raise KafkaError(f"topic {topic} does not exist (run `stream-rl topics apply --run <run>`)")
        if t.error is not None or not t.partitions:
            raise TransientKafkaError(t.error.str() if t.error else f"{topic}: no partitions listed yet")
        return md

    def replication_factor(self, topic: str) -> int:
        """Replicas of the topic's partitions (the smallest, should they differ)."""
        return self._retry(lambda: self._replication_factor(topic), f"describe {topic}")

    def _replication_factor(self, topic: str) -> int:
        partitions = self._topic_metadata(topic, 10.0).topics[topic].partitions
        return min(len(p.replicas) for p in partitions.values())

    def broker_count(self) -> int:
        """Brokers in the cluster's metadata."""
        return self._retry(lambda: len(self.admin.list_topics(timeout=10.0).brokers), "list brokers")

    def watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        return self._retry(lambda: self._watermarks(topic), f"list offsets of {topic}")

    def log_ends(self, topic: str) -> dict[int, int]:
        return self._retry(
            lambda: {p: high for p, (_low, high) in self._watermarks(topic, committed=False).items()},
            f"list offsets of {topic}",
        )

    def _watermarks(self, topic: str, committed: bool = True) -> dict[int, tuple[int, int]]:
        from confluent_kafka.admin import OffsetSpec

        md = self._topic_metadata(topic, 10.0)
        leaders = leaders_of(md, topic)
        # Short tries, and a leader that gave no offset is asked again only once it accepts
        # connections: librdkafka's ListOffsets spins on a dead leader (stream_rl/kafka/leaders.py).
        timeout = self._leaders.check(topic, leaders)
        isolation = ck.IsolationLevel.READ_COMMITTED if committed else ck.IsolationLevel.READ_UNCOMMITTED
        out: dict[int, tuple[int, int]] = {p: (0, 0) for p in leaders}
        for idx, spec in enumerate((OffsetSpec.earliest(), OffsetSpec.latest())):
            futs = self.admin.list_offsets(
                {ck.TopicPartition(topic, p): spec for p in leaders},
                isolation_level=isolation,
                request_timeout=timeout,
            )
            for tp, fut in futs.items():
                try:
                    off = fut.result().offset
                except ck.KafkaException as exc:
                    if exc.args and exc.args[0].code() == ck.KafkaError._TIMED_OUT:
                        self._leaders.record(leaders[tp.partition], md.brokers)
                    raise
                if off < 0:  # librdkafka's "no offset" (-1001) for a leader that did not answer
                    node = leaders[tp.partition]
                    self._leaders.record(node, md.brokers)
                    raise TransientKafkaError(
                        f"{topic} partition {tp.partition}: its leader (node {node}) gave no offset"
                    )
                low, high = out[tp.partition]
                out[tp.partition] = (off, high) if idx == 0 else (low, off)
        return out

    def group_offsets(self, group_id: str, topic: str) -> dict[int, int]:
        return self._retry(lambda: self._group_offsets(group_id, topic), f"offsets of group {group_id}")

    def _group_offsets(self, group_id: str, topic: str) -> dict[int, int]:
        # A consumer's OffsetFetch, not the admin API: librdkafka's coordinator-bound admin calls
        # (list_consumer_group_offsets, describe_consumer_groups) abort the process when the
        # connection drops mid-call (`rd_kafka_enq_once_del_source_return: Assertion` in
        # librdkafka 2.16, confluentinc/librdkafka#4605), which a broker restart does.
        parts = self._partitions(topic, 10.0)
        consumer = self._offsets_consumer(group_id)
        res = consumer.committed([ck.TopicPartition(topic, p) for p in parts], timeout=10)
        consumer.poll(0)  # serves its queued log lines
        return {r.partition: (r.offset if r.error is None and r.offset >= 0 else -1) for r in res}

    def _offsets_consumer(self, group_id: str) -> ck.Consumer:
        """A consumer of `group_id` that never subscribes: it only reads the group's offsets."""
        consumer = self._offset_readers.get(group_id)
        if consumer is None:
            consumer = build_client(
                ck.Consumer,
                {
                    "bootstrap.servers": self.bootstrap,
                    "group.id": group_id,
                    "client.id": "stream-rl-offsets",
                    "enable.auto.commit": False,
                    "logger": CLIENT_LOG,
                    **client_conf(self.properties),
                },
            )
            self._offset_readers[group_id] = consumer
        return consumer

    def group_members(self, group_id: str) -> int:
        """Live members (admin DescribeConsumerGroups). Not for long-lived processes: a broker
        restart during the call can abort the process (see `_group_offsets`)."""
        return self._retry(lambda: self._group_members(group_id), f"describe group {group_id}")

    def _group_members(self, group_id: str) -> int:
        desc = self.admin.describe_consumer_groups([group_id], request_timeout=15)[group_id].result()
        return len(desc.members or [])

    def create_topics(
        self,
        topics: list[tuple[str, int, dict[str, str]]],
        replication_factors: Mapping[str, int] | None = None,
    ) -> list[str]:
        if not topics:
            return []
        factors = replication_factors or {}
        new = [
            NewTopic(name, num_partitions=parts, replication_factor=factors.get(name, 1), config=conf)
            for name, parts, conf in topics
        ]
        created = []
        for name, fut in self.admin.create_topics(new, operation_timeout=30, request_timeout=30).items():
            try:
                fut.result()
                created.append(name)
                self._created[name] = time.monotonic()
            except ck.KafkaException as exc:
                if exc.args[0].code() != ck.KafkaError.TOPIC_ALREADY_EXISTS:
                    raise fail(f"create topic {name}", exc) from exc
        if created:
            self._wait_for_leaders(created)
        return created

    def _wait_for_leaders(self, topics: list[str], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        pending = set(topics)
        while pending and time.monotonic() < deadline:
            md = self.admin.list_topics(timeout=5)
            for name in list(pending):
                t = md.topics.get(name)
                if (
                    t is not None
                    and t.error is None
                    and t.partitions
                    and all(p.leader >= 0 for p in t.partitions.values())
                ):
                    pending.discard(name)
            if pending:
                time.sleep(0.1)
        if pending:
            raise KafkaError(f"topics without a leader after {timeout}s: {sorted(pending)}")

    def topic_configs(self, topics: list[str], settle_s: float = 10.0) -> dict[str, dict[str, str]]:
        """Each topic's configs. A topic created a moment ago may not be known yet to the broker
        asked (a cluster's metadata spreads in the background): that is retried for `settle_s`."""
        from confluent_kafka.admin import ConfigResource

        out: dict[str, dict[str, str]] = {}
        pending = list(topics)
        deadline = time.monotonic() + settle_s
        while pending:
            res = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in pending]
            pending = []
            for r, fut in self.admin.describe_configs(res, request_timeout=15).items():
                try:
                    entries = fut.result()
                except ck.KafkaException as exc:
                    unknown = exc.args[0].code() == ck.KafkaError.UNKNOWN_TOPIC_OR_PART
                    if unknown and time.monotonic() < deadline:
                        pending.append(r.name)
                        continue
                    raise fail(f"describe configs of {r.name}", exc) from exc
                out[r.name] = {k: v.value for k, v in entries.items()}
            if pending:
                time.sleep(0.2)
        return out

    def list_topic_names(self) -> list[str]:
        try:
            return sorted(self.admin.list_topics(timeout=10).topics)
        except ck.KafkaException as exc:
            raise fail("list topics", exc) from exc

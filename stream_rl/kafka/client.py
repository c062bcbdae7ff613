"""The real transport: confluent-kafka (librdkafka) producers, consumers and admin calls."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient, NewTopic

from stream_rl.errors import KafkaError
from stream_rl.kafka.transport import (
    Headers,
    Message,
    RebalanceCallback,
    TopicPartition,
)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
T = TypeVar("T")
log = logging.getLogger(__name__)

# A commit refused because the group rebalanced after these records were fetched (a replica joined
# or left: `docker compose up --scale`). Every caller flushes its outputs before committing, so
# dropping the commit keeps at least once: whoever owns the partitions now resumes at the last
# committed offset, and the preprocessor drops the duplicates by rollout id.
_REBALANCED = (
    ck.KafkaError.ILLEGAL_GENERATION,
    ck.KafkaError.UNKNOWN_MEMBER_ID,
    ck.KafkaError.REBALANCE_IN_PROGRESS,
)


def _fail(what: str, exc: ck.KafkaException) -> KafkaError:
    return KafkaError(f"{what}: {exc.args[0] if exc.args else exc}")


_LEADERSHIP = (
    ck.KafkaError.NOT_LEADER_FOR_PARTITION,
    ck.KafkaError.LEADER_NOT_AVAILABLE,
    ck.KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    ck.KafkaError.COORDINATOR_NOT_AVAILABLE,
    ck.KafkaError.NOT_COORDINATOR,
)


def _retry_transient(fn: Callable[[], T], what: str, timeout: float = 15.0) -> T:
    """Retry an admin call on retriable errors (e.g. leader elections right after a restart)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except ck.KafkaException as exc:
            err = exc.args[0] if exc.args else None
            # Leadership and coordinator errors right after topic creation or a (re)start are not
            # flagged retriable by every admin call, but they pass once the broker settles.
            retriable = isinstance(err, ck.KafkaError) and (err.retriable() or err.code() in _LEADERSHIP)
            if not retriable or time.monotonic() > deadline:
                raise _fail(what, exc) from exc
            time.sleep(0.2)


def _headers(headers: Headers | None) -> list[tuple[str, bytes]] | None:
    if not headers:
        return None
    return [(k, v.encode() if isinstance(v, str) else v) for k, v in headers.items()]


class KafkaProducer:
    """Idempotent producer; transactional when given a transactional id."""

    def __init__(
        self,
        bootstrap: str,
        client_id: str,
        transactional_id: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        conf: dict[str, Any] = {
            "bootstrap.servers": bootstrap,
            "client.id": client_id,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "compression.type": "zstd",
            "message.max.bytes": MAX_MESSAGE_BYTES,
        }
        if transactional_id:
            conf["transactional.id"] = transactional_id
            # Short: a killed instance that is not restarted under the same id blocks read_committed
            # consumers (the LSO) until its open transaction times out.
            conf["transaction.timeout.ms"] = 15000
        conf.update(extra or {})
        self._p = ck.Producer(conf)
        self._errors: list[str] = []

    def _on_delivery(self, err: ck.KafkaError | None, msg: ck.Message) -> None:
        if err is not None:
            self._errors.append(f"{msg.topic()}: {err.str()}")

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | str | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> None:
        kwargs: dict[str, Any] = {
            "value": value,
            "key": key,
            "headers": _headers(headers),
            "on_delivery": self._on_delivery,
        }
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self._p.produce(topic, **kwargs)
                break
            except BufferError:
                self._p.poll(0.1)  # local queue full: let deliveries drain
            except ck.KafkaException as exc:
                raise _fail(f"produce to {topic}", exc) from exc
        self._p.poll(0)

    def flush(self, timeout: float = 30.0) -> None:
        remaining = self._p.flush(timeout)
        if remaining:
            raise KafkaError(f"{remaining} records not delivered within {timeout}s (is the broker up?)")
        if self._errors:
            errors, self._errors = self._errors, []
            raise KafkaError(f"{len(errors)} records failed delivery; first: {errors[0]}")

    def init_transactions(self, timeout: float = 30.0) -> None:
        try:
            self._p.init_transactions(timeout)
        except ck.KafkaException as exc:
            raise _fail("init_transactions", exc) from exc

    def begin_transaction(self) -> None:
        self._p.begin_transaction()

    def send_offsets_to_transaction(
        self, offsets: Mapping[TopicPartition, int], group_metadata: Any, timeout: float = 30.0
    ) -> None:
        tps = [ck.TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        self._p.send_offsets_to_transaction(tps, group_metadata, timeout)

    def commit_transaction(self, timeout: float = 30.0) -> None:
        self._p.commit_transaction(timeout)
        self._errors.clear()

    def abort_transaction(self, timeout: float = 30.0) -> None:
        self._p.abort_transaction(timeout)
        self._errors.clear()

    def close(self) -> None:
        self._p.flush(5.0)


STATIC_SESSION_TIMEOUT_MS = 30000


class KafkaConsumer:
    """Manual-commit, read_committed consumer with cooperative rebalancing."""

    def __init__(
        self, bootstrap: str, group_id: str | None, client_id: str, extra: Mapping[str, Any] | None = None
    ) -> None:
        conf: dict[str, Any] = {
            "bootstrap.servers": bootstrap,
            "client.id": client_id,
            # librdkafka needs a group id even for assign()-only use; it never commits then.
            "group.id": group_id or f"{client_id}.nogroup",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "partition.assignment.strategy": "cooperative-sticky",
            "max.partition.fetch.bytes": MAX_MESSAGE_BYTES,
            # The broker answers a fetch as soon as any data is there (fetch.min.bytes=1); this only
            # bounds an idle fetch, so it can be long without adding latency.
            "fetch.wait.max.ms": 250,
            "session.timeout.ms": 6000,  # the broker minimum: a dead member is noticed fast
            "heartbeat.interval.ms": 1000,
            "max.poll.interval.ms": 600000,
        }
        conf.update(extra or {})
        self._c = ck.Consumer(conf)
        self._has_group = group_id is not None

    def subscribe(
        self,
        topics: list[str],
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
    ) -> None:
        def assign_cb(consumer: ck.Consumer, parts: list[ck.TopicPartition]) -> None:
            if on_assign:
                on_assign([(p.topic, p.partition) for p in parts])

        def revoke_cb(consumer: ck.Consumer, parts: list[ck.TopicPartition]) -> None:
            if on_revoke:
                on_revoke([(p.topic, p.partition) for p in parts])

        self._c.subscribe(topics, on_assign=assign_cb, on_revoke=revoke_cb, on_lost=revoke_cb)

    def assign(self, offsets: Mapping[TopicPartition, int]) -> None:
        self._c.assign([ck.TopicPartition(t, p, o) for (t, p), o in offsets.items()])

    def poll_batch(self, max_records: int, timeout: float) -> list[Message]:
        """Up to `max_records` records: returns as soon as one is there (with what else is
        already fetched), or empty after `timeout`. (librdkafka's consume() alone would wait for
        a full batch or the timeout: latency at every stage of the pipeline.)"""
        try:
            first = self._c.poll(timeout)
            msgs = [] if first is None else [first]
            if first is not None and max_records > 1:
                msgs.extend(self._c.consume(max_records - 1, 0))
        except ck.KafkaException as exc:
            raise _fail("consume", exc) from exc
        out = []
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == ck.KafkaError._PARTITION_EOF:
                    continue
                if err.code() in (ck.KafkaError.UNKNOWN_TOPIC_OR_PART, ck.KafkaError._UNKNOWN_TOPIC):
                    raise KafkaError(f"{err.str()} (run `stream-rl topics apply --run <run>` first)")
                if err.fatal():
                    raise KafkaError(f"consume: {err.str()}")
                continue  # transient broker/network errors: librdkafka retries on its own
            ts_type, ts = m.timestamp()
            raw_headers = m.headers() or []
            pairs = raw_headers.items() if isinstance(raw_headers, dict) else raw_headers
            out.append(
                Message(
                    topic=m.topic() or "",
                    partition=m.partition() or 0,
                    offset=m.offset() or 0,
                    key=m.key(),
                    value=m.value(),
                    headers=[(k, v if isinstance(v, bytes) else (v or "").encode()) for k, v in pairs],
                    timestamp_ms=ts if ts_type != ck.TIMESTAMP_NOT_AVAILABLE else 0,
                )
            )
        return out

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit synchronously; a commit the group's rebalance refused is dropped with a warning
        (see `_REBALANCED`), any other failure raises KafkaError."""
        if not offsets:
            return
        try:
            self._c.commit(
                offsets=[ck.TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False
            )
        except ck.KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, ck.KafkaError) and err.code() in _REBALANCED:
                log.warning(
                    "commit dropped, the group rebalanced meanwhile (%s): records may be redone", err.str()
                )
                return
            raise _fail("commit", exc) from exc

    def committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        if not partitions:
            return {}
        try:
            res = self._c.committed([ck.TopicPartition(t, p) for t, p in partitions], timeout=30)
        except ck.KafkaException as exc:
            raise _fail("committed", exc) from exc
        return {(r.topic, r.partition): (r.offset if r.offset >= 0 else -1) for r in res}

    def position(self) -> dict[TopicPartition, int]:
        parts = self._c.assignment()
        if not parts:
            return {}
        return {(r.topic, r.partition): r.offset for r in self._c.position(parts)}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._c.seek(ck.TopicPartition(tp[0], tp[1], offset))

    def assignment(self) -> list[TopicPartition]:
        return [(p.topic, p.partition) for p in self._c.assignment()]

    def group_metadata(self) -> Any:
        return self._c.consumer_group_metadata()

    def close(self) -> None:
        self._c.close()


class KafkaTransport:
    """Factory of clients for one cluster, plus the admin calls the stages need."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self._admin: AdminClient | None = None

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient({"bootstrap.servers": self.bootstrap})
        return self._admin

    def producer(self, client_id: str, transactional_id: str | None = None) -> KafkaProducer:
        return KafkaProducer(self.bootstrap, client_id, transactional_id)

    def consumer(self, group_id: str | None, client_id: str, instance_id: str | None = None) -> KafkaConsumer:
        extra: dict[str, Any] | None = None
        if instance_id and group_id:
            # A static member that misses its session is fenced on its next commit, a fatal error
            # for librdkafka (the stage dies). A restart under the same id takes over at once, so a
            # long session costs nothing there; a short one killed stages whose process or broker
            # was starved of CPU for 6 s (seen on a 2-core machine with pinned CPUs).
            extra = {"group.instance.id": instance_id, "session.timeout.ms": STATIC_SESSION_TIMEOUT_MS}
        return KafkaConsumer(self.bootstrap, group_id, client_id, extra)

    def partitions(self, topic: str, timeout: float = 10.0) -> list[int]:
        try:
            md = self.admin.list_topics(topic=topic, timeout=timeout)
        except ck.KafkaException as exc:
            raise _fail(f"describe {topic}", exc) from exc
        t = md.topics.get(topic)
        if t is None or t.error is not None:
            raise KafkaError(f"topic {topic} does not exist (run `stream-rl topics apply --run <run>`)")
        return sorted(t.partitions)

    def watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        return _retry_transient(lambda: self._watermarks(topic), f"list offsets of {topic}")

    def _watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        from confluent_kafka.admin import OffsetSpec

        parts = self.partitions(topic)
        out: dict[int, tuple[int, int]] = {p: (0, 0) for p in parts}
        for idx, spec in enumerate((OffsetSpec.earliest(), OffsetSpec.latest())):
            futs = self.admin.list_offsets(
                {ck.TopicPartition(topic, p): spec for p in parts},
                isolation_level=ck.IsolationLevel.READ_COMMITTED,
                request_timeout=15,
            )
            for tp, fut in futs.items():
                off = fut.result().offset
                low, high = out[tp.partition]
                out[tp.partition] = (off, high) if idx == 0 else (low, off)
        return out

    def group_offsets(self, group_id: str, topic: str) -> dict[int, int]:
        # list_consumer_group_offsets can crash the process (confluent-kafka 2.16.1, SIGSEGV) when
        # it gets COORDINATOR_LOAD_IN_PROGRESS, as on a freshly started broker; describing the
        # group first fails cleanly until the group's coordinator has loaded.
        self.group_members(group_id)
        return _retry_transient(lambda: self._group_offsets(group_id, topic), f"offsets of group {group_id}")

    def _group_offsets(self, group_id: str, topic: str) -> dict[int, int]:
        from confluent_kafka import ConsumerGroupTopicPartitions

        parts = self.partitions(topic)
        req = ConsumerGroupTopicPartitions(group_id, [ck.TopicPartition(topic, p) for p in parts])
        futs = self.admin.list_consumer_group_offsets([req], request_timeout=15)
        out = {p: -1 for p in parts}
        for fut in futs.values():
            res = fut.result()
            for tp in res.topic_partitions:
                if tp.error is None and tp.offset >= 0:
                    out[tp.partition] = tp.offset
        return out

    def group_members(self, group_id: str) -> int:
        return _retry_transient(lambda: self._group_members(group_id), f"describe group {group_id}")

    def _group_members(self, group_id: str) -> int:
        desc = self.admin.describe_consumer_groups([group_id], request_timeout=15)[group_id].result()
        return len(desc.members or [])

    def create_topics(self, topics: list[tuple[str, int, dict[str, str]]]) -> list[str]:
        if not topics:
            return []
        new = [
            NewTopic(name, num_partitions=parts, replication_factor=1, config=conf)
            for name, parts, conf in topics
        ]
        created = []
        for name, fut in self.admin.create_topics(new, operation_timeout=30, request_timeout=30).items():
            try:
                fut.result()
                created.append(name)
            except ck.KafkaException as exc:
                if exc.args[0].code() != ck.KafkaError.TOPIC_ALREADY_EXISTS:
                    raise _fail(f"create topic {name}", exc) from exc
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

    def topic_configs(self, topics: list[str]) -> dict[str, dict[str, str]]:
        from confluent_kafka.admin import ConfigResource

        res = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics]
        out: dict[str, dict[str, str]] = {}
        for r, fut in self.admin.describe_configs(res, request_timeout=15).items():
            try:
                entries = fut.result()
            except ck.KafkaException as exc:
                raise _fail(f"describe configs of {r.name}", exc) from exc
            out[r.name] = {k: v.value for k, v in entries.items()}
        return out

    def list_topic_names(self) -> list[str]:
        try:
            return sorted(self.admin.list_topics(timeout=10).topics)
        except ck.KafkaException as exc:
            raise _fail("list topics", exc) from exc

"""The real transport: confluent-kafka (librdkafka) producers, consumers and admin calls."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient, NewTopic

from stream_rl.errors import KafkaError, TransactionAborted
from stream_rl.kafka.outage import (
    CLIENT_LOG,
    DEFAULT_OUTAGE_S,
    Backoff,
    TransientKafkaError,
    reachable_wait_s,
    retry,
    transient,
)
from stream_rl.kafka.transport import (
    Headers,
    Message,
    RebalanceCallback,
    TopicPartition,
)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_COMPRESSION = "zstd"
log = logging.getLogger("stream_rl.kafka")
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


def check_reachable(bootstrap: str, timeout: float | None = None) -> None:
    """Raise a one-line KafkaError unless a broker at `bootstrap` answers within `timeout`
    (default 10 s, or $STREAM_RL_KAFKA_REACHABLE_WAIT_S)."""
    timeout = reachable_wait_s() if timeout is None else timeout
    admin = AdminClient(
        {"bootstrap.servers": bootstrap, "log_level": 0, "socket.connection.setup.timeout.ms": 3000}
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            if admin.list_topics(timeout=min(2.0, max(deadline - time.monotonic(), 0.1))).brokers:
                return
        except ck.KafkaException:
            pass
        if time.monotonic() >= deadline:
            raise KafkaError(
                f"no Kafka broker answers at {bootstrap} (waited {timeout:.0f}s): start one "
                "(`stream-rl kafka up`) or fix kafka.bootstrap / --bootstrap / $STREAM_RL_KAFKA_BOOTSTRAP"
            )
        time.sleep(0.3)


BOUNDED_GRACE_S = 15.0
"""How long past its own timeout a librdkafka call is waited for before it is abandoned."""


class Wedged(KafkaError):
    """A librdkafka call did not return: the client is unusable (any further transaction call
    conflicts with the abandoned one); the stage must exit and be restarted."""


def _bounded(what: str, call: Callable[[float], None], timeout: float) -> None:
    """`call(timeout)` in a helper thread, abandoned with a KafkaError if it has not returned well
    after its timeout: right after a broker restart librdkafka's send_offsets_to_transaction was
    seen blocking for minutes past it (the preprocessor then hung; now it fails, and is restarted)."""
    import threading

    box: list[BaseException | None] = []

    def run() -> None:
        try:
            call(timeout)
            box.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            box.append(exc)

    thread = threading.Thread(target=run, name=f"kafka-{what}", daemon=True)
    thread.start()
    thread.join(timeout + BOUNDED_GRACE_S)
    if not box:
        limit = timeout + BOUNDED_GRACE_S
        raise Wedged(f"{what}: librdkafka did not return within {limit:.0f}s (restart the stage)")
    if box[0] is not None:
        raise box[0]


class _Errors:
    """The `error_cb` of a client: fatal errors are kept (the next call raises them: a fenced
    static member's consumer otherwise just stops delivering, and its stage hangs); the others,
    mostly connection errors librdkafka recovers from, are logged rate-limited."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.fatal: str | None = None

    def __call__(self, err: ck.KafkaError) -> None:
        if err.fatal():
            self.fatal = err.str()
            log.error("%s: fatal Kafka client error: %s", self.client_id, err.str())
        else:
            CLIENT_LOG.log(logging.WARNING, "%s [%s] %s", "ERROR", self.client_id, err.str())

    def check(self, what: str) -> None:
        if self.fatal is not None:
            raise KafkaError(f"{what}: fatal Kafka client error (restart the stage): {self.fatal}")


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
        outage_s: float = DEFAULT_OUTAGE_S,
        compression: str = DEFAULT_COMPRESSION,
    ) -> None:
        self.outage_s = outage_s
        self._fatal = _Errors(client_id)
        conf: dict[str, Any] = {
            "bootstrap.servers": bootstrap,
            "client.id": client_id,
            "logger": CLIENT_LOG,
            "error_cb": self._fatal,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "compression.type": compression,
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
        self._wedged = False

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
        self._fatal.check(f"produce to {topic}")

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every record is acknowledged: through a broker outage, for up to
        `timeout` (default the outage timeout). librdkafka re-sends on its own meanwhile."""
        limit = self.outage_s if timeout is None else timeout
        started = time.monotonic()
        warned = False
        while True:
            remaining = self._p.flush(min(1.0, max(started + limit - time.monotonic(), 0.0)))
            waited = time.monotonic() - started
            if not remaining or waited >= limit:
                break
            if not warned and waited >= 5.0:
                warned = True
                log.warning(
                    "flush: %d records not acknowledged after 5s; waiting up to %.0fs", remaining, limit
                )
        self._fatal.check("flush")
        if remaining:
            raise KafkaError(f"{remaining} records not delivered within {limit:.0f}s (is the broker up?)")
        if warned:
            log.warning("flush: delivered after %.1fs", time.monotonic() - started)
        if self._errors:
            errors, self._errors = self._errors, []
            raise KafkaError(f"{len(errors)} records failed delivery; first: {errors[0]}")

    def init_transactions(self, timeout: float = 30.0) -> None:
        try:
            self._p.init_transactions(timeout)
        except ck.KafkaException as exc:
            raise _fail("init_transactions", exc) from exc

    def begin_transaction(self) -> None:
        try:
            self._p.begin_transaction()
        except ck.KafkaException as exc:
            raise _fail("begin_transaction", exc) from exc

    def _transaction_step(self, what: str, call: Callable[[float], None], timeout: float) -> None:
        """A transaction call, retried through an outage (librdkafka allows calling a timed-out
        send_offsets/commit again); a transaction that must be aborted is aborted and reported
        as `TransactionAborted`."""
        backoff = Backoff(what, self.outage_s)
        while True:
            try:
                _bounded(what, call, min(timeout, max(backoff.left(), 1.0)))
                backoff.done()
                return
            except Wedged:
                self._wedged = True
                raise
            except ck.KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, ck.KafkaError) and err.txn_requires_abort():
                    self.abort_transaction()
                    raise TransactionAborted(f"{what}: {err.str()} (transaction aborted)") from exc
                retriable = isinstance(err, ck.KafkaError) and (err.retriable() or transient(err))
                if retriable and backoff.wait(str(err)):
                    continue
                raise _fail(what, exc) from exc

    def send_offsets_to_transaction(
        self, offsets: Mapping[TopicPartition, int], group_metadata: Any, timeout: float = 30.0
    ) -> None:
        tps = [ck.TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        self._transaction_step(
            "send_offsets_to_transaction",
            lambda t: self._p.send_offsets_to_transaction(tps, group_metadata, t),
            timeout,
        )

    def commit_transaction(self, timeout: float = 30.0) -> None:
        self._transaction_step("commit_transaction", self._p.commit_transaction, timeout)
        self._errors.clear()

    def abort_transaction(self, timeout: float = 30.0) -> None:
        if self._wedged:
            raise Wedged("abort_transaction: the producer is wedged (an abandoned call); restart the stage")

        def call() -> None:
            _bounded("abort_transaction", self._p.abort_transaction, timeout)

        retry(call, "abort_transaction", self.outage_s, _fail)
        self._errors.clear()

    def close(self) -> None:
        self._p.flush(5.0)


STATIC_SESSION_TIMEOUT_MS = 30000


class KafkaConsumer:
    """Manual-commit, read_committed consumer with cooperative rebalancing."""

    def __init__(
        self,
        bootstrap: str,
        group_id: str | None,
        client_id: str,
        extra: Mapping[str, Any] | None = None,
        outage_s: float = DEFAULT_OUTAGE_S,
    ) -> None:
        self.outage_s = outage_s
        self._fatal = _Errors(client_id)
        conf: dict[str, Any] = {
            "bootstrap.servers": bootstrap,
            "client.id": client_id,
            "logger": CLIENT_LOG,
            "error_cb": self._fatal,
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
            "fetch.wait.max.ms": 500,
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
        self._fatal.check("consume")
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
        tps = [ck.TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        try:
            retry(lambda: self._c.commit(offsets=tps, asynchronous=False), "commit", self.outage_s, _fail)
        except KafkaError as exc:
            cause = exc.__cause__
            err = cause.args[0] if isinstance(cause, ck.KafkaException) and cause.args else None
            if isinstance(err, ck.KafkaError) and err.code() in _REBALANCED:
                log.warning(
                    "commit dropped, the group rebalanced meanwhile (%s): records may be redone", err.str()
                )
                return
            raise

    def committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        if not partitions:
            return {}
        tps = [ck.TopicPartition(t, p) for t, p in partitions]
        res = retry(lambda: self._c.committed(tps, timeout=10), "committed", self.outage_s, _fail)
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

    def pause(self, partitions: list[TopicPartition]) -> None:
        if partitions:
            self._c.pause([ck.TopicPartition(t, p) for t, p in partitions])

    def resume(self, partitions: list[TopicPartition]) -> None:
        if partitions:
            self._c.resume([ck.TopicPartition(t, p) for t, p in partitions])

    def end_offset(self, tp: TopicPartition) -> int:
        try:
            _low, high = self._c.get_watermark_offsets(ck.TopicPartition(*tp), cached=True)
        except ck.KafkaException:
            return -1
        return int(high) if high is not None and high >= 0 else -1

    def group_metadata(self) -> Any:
        return self._c.consumer_group_metadata()

    def close(self) -> None:
        self._c.close()


class KafkaTransport:
    """Factory of clients for one cluster, plus the admin calls the stages need."""

    def __init__(
        self, bootstrap: str, outage_s: float = DEFAULT_OUTAGE_S, compression: str = DEFAULT_COMPRESSION
    ) -> None:
        self.bootstrap = bootstrap
        self.outage_s = outage_s
        self.compression = compression
        """How long calls wait out a broker that does not answer (`kafka.outage_timeout_s`)."""
        self._admin: AdminClient | None = None
        self._offset_readers: dict[str, ck.Consumer] = {}

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap, "logger": CLIENT_LOG}
            self._admin = AdminClient(conf)
        return self._admin

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        try:
            return retry(fn, what, self.outage_s, _fail)
        finally:
            if self._admin is not None:
                self._admin.poll(0)  # serves its queued log lines (they would pile up otherwise)

    def check_reachable(self, timeout: float | None = None) -> None:
        check_reachable(self.bootstrap, timeout)

    def producer(self, client_id: str, transactional_id: str | None = None) -> KafkaProducer:
        return KafkaProducer(
            self.bootstrap, client_id, transactional_id, outage_s=self.outage_s, compression=self.compression
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
        return KafkaConsumer(self.bootstrap, group_id, client_id, extra, outage_s=self.outage_s)

    def partitions(self, topic: str, timeout: float = 10.0) -> list[int]:
        return self._retry(lambda: self._partitions(topic, timeout), f"describe {topic}")

    def _partitions(self, topic: str, timeout: float) -> list[int]:
        md = self.admin.list_topics(topic=topic, timeout=timeout)
        t = md.topics.get(topic)
        if t is None or (t.error is not None and t.error.code() == ck.KafkaError.UNKNOWN_TOPIC_OR_PART):
            raise KafkaError(f"topic {topic} does not exist (run `stream-rl topics apply --run <run>`)")
        if t.error is not None:
            raise TransientKafkaError(t.error.str())  # e.g. no leader yet, right after a restart
        return sorted(t.partitions)

    def watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        return self._retry(lambda: self._watermarks(topic), f"list offsets of {topic}")

    def _watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        from confluent_kafka.admin import OffsetSpec

        parts = self._partitions(topic, 10.0)
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
            consumer = ck.Consumer(
                {
                    "bootstrap.servers": self.bootstrap,
                    "group.id": group_id,
                    "client.id": "stream-rl-offsets",
                    "enable.auto.commit": False,
                    "logger": CLIENT_LOG,
                }
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

"""`KafkaConsumer`: the manual-commit, read_committed consumer with cooperative rebalancing every
stage reads with (a commit a rebalance refused is dropped: at least once holds)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import confluent_kafka as ck

from stream_rl.errors import KafkaError
from stream_rl.kafka.librdkafka import (
    MAX_MESSAGE_BYTES,
    ClientErrors,
    Properties,
    base_conf,
    build_client,
    client_conf,
    fail,
    principal,
    refusal,
)
from stream_rl.kafka.outage import DEFAULT_OUTAGE_S, retry
from stream_rl.kafka.transport import Message, RebalanceCallback, TopicPartition

log = logging.getLogger(
    "stream_rl.kafka.confluent"
)  # the name from before the split: log filters keep working


# A commit refused because the group rebalanced after these records were fetched (a replica joined
# or left: `docker compose up --scale`). Every caller flushes its outputs before committing, so
# dropping the commit keeps at least once: whoever owns the partitions now resumes at the last
# committed offset, and the preprocessor drops the duplicates by rollout id.
_REBALANCED = (
    ck.KafkaError.ILLEGAL_GENERATION,
    ck.KafkaError.UNKNOWN_MEMBER_ID,
    ck.KafkaError.REBALANCE_IN_PROGRESS,
)


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
        properties: Properties | None = None,
    ) -> None:
        self.outage_s = outage_s
        self._fatal = ClientErrors(client_id)
        conf: dict[str, Any] = {
            **base_conf(bootstrap, client_id, self._fatal),
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
        conf.update(client_conf(properties))  # the user's (security, tuning) over our defaults
        conf.update(extra or {})  # static membership: ours, it carries the stage's identity
        self._c = build_client(ck.Consumer, conf)
        self._has_group = group_id is not None
        self._group = group_id
        self._who = principal(properties)

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
            raise fail("consume", exc) from exc
        self._fatal.check("consume")
        out = []
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == ck.KafkaError._PARTITION_EOF:
                    continue
                if err.code() in (ck.KafkaError.UNKNOWN_TOPIC_OR_PART, ck.KafkaError._UNKNOWN_TOPIC):
                    raise KafkaError(f"{err.str()} (run `stream-rl topics apply --run <run>` first)")
                if err.code() == ck.KafkaError.TOPIC_AUTHORIZATION_FAILED:
                    raise refusal(err, self._who, "READ", m.topic() or "")
                if err.code() == ck.KafkaError.GROUP_AUTHORIZATION_FAILED and self._has_group:
                    # (an assign-only reader's `.nogroup` lookup is refused too, harmlessly: acls.py)
                    raise refusal(err, self._who, "READ", self._group or "")
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
            retry(lambda: self._c.commit(offsets=tps, asynchronous=False), "commit", self.outage_s, fail)
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
        res = retry(lambda: self._c.committed(tps, timeout=10), "committed", self.outage_s, fail)
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

"""`KafkaProducer`: the idempotent (and, given a transactional id, transactional) producer every
stage writes with; flushes and transaction calls wait out a broker outage."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import confluent_kafka as ck

from stream_rl.errors import KafkaError, TransactionAborted
from stream_rl.kafka.librdkafka import (
    DEFAULT_COMPRESSION,
    MAX_MESSAGE_BYTES,
    ClientErrors,
    Properties,
    Wedged,
    base_conf,
    bounded,
    build_client,
    client_conf,
    fail,
    is_refusal,
    principal,
    refusal,
)
from stream_rl.kafka.outage import DEFAULT_OUTAGE_S, Backoff, retry, transient
from stream_rl.kafka.transport import Headers, TopicPartition

log = logging.getLogger(
    "stream_rl.kafka.confluent"
)  # the name from before the split: log filters keep working

TRANSACTION_CALL_S = 10.0
"""One try of a transaction step (send_offsets, commit, abort): a timed-out try is retried through
an outage (`kafka.outage_timeout_s`), and a try that has not returned `BOUNDED_GRACE_S` after
this wedges the producer (librdkafka#5456: send_offsets_to_transaction can ignore its timeout
right after a broker restart), so the stage is restarted within 15 s of that instead of 45 s.
Such a step takes milliseconds when the broker answers."""


STUCK_S = 30.0
"""Records that no acknowledgement moved for this long while the broker answers metadata requests
all along are stuck in librdkafka: seen after a broker restart ("new leader not found in cache"
for their partition, then nothing for minutes, until the watchdog killed the stage); the
producer is then wedged and the stage restarts (a restarted stage re-produces from its
committed input), instead of waiting out `kafka.outage_timeout_s`."""


class _StuckDelivery:
    """Tells a flush that waits on an outage (the broker does not answer: wait) from one stuck
    with the broker answering (give up after `STUCK_S`). `answers` is asked at most every 5 s,
    once no record was acknowledged for 5 s."""

    def __init__(self, answers: Callable[[], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self.answers, self.clock = answers, clock
        self.remaining: int | None = None
        self.moved = self.asked = clock()
        self.answering_since: float | None = None

    def check(self, remaining: int) -> bool:
        now = self.clock()
        if remaining != self.remaining:
            self.remaining, self.moved = remaining, now
        if now - self.moved < 5.0 or now - self.asked < 5.0:
            return False
        self.asked = now
        if not self.answers():
            self.answering_since = None
            return False
        if self.answering_since is None:
            self.answering_since = now
        return now - max(self.moved, self.answering_since) >= STUCK_S


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
        properties: Properties | None = None,
    ) -> None:
        self.outage_s = outage_s
        self._fatal = ClientErrors(client_id)
        conf: dict[str, Any] = {
            **base_conf(bootstrap, client_id, self._fatal),
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
        conf.update(client_conf(properties))  # the user's (security, tuning) over our defaults
        conf.update(extra or {})
        self._p = build_client(ck.Producer, conf)
        self._who = principal(properties)
        self._transactional_id = transactional_id
        self._errors: list[str] = []
        self._wedged = False

    def _refused(self, err: ck.KafkaError, topic: str) -> KafkaError:
        op = "IDEMPOTENT_WRITE" if err.code() == ck.KafkaError.CLUSTER_AUTHORIZATION_FAILED else "WRITE"
        return refusal(err, self._who, op, topic)

    def _on_delivery(self, err: ck.KafkaError | None, msg: ck.Message) -> None:
        if err is not None and is_refusal(err):
            self._errors.append(str(self._refused(err, msg.topic() or "")))
        elif err is not None:
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
                # A refusal comes here when librdkafka already knows it (the topic's metadata said
                # so), else in the delivery report at flush: the same one line either way.
                if exc.args and is_refusal(exc.args[0]):
                    raise self._refused(exc.args[0], topic) from exc
                raise fail(f"produce to {topic}", exc) from exc
        self._p.poll(0)
        self._fatal.check(f"produce to {topic}")

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every record is acknowledged: through a broker outage, for up to
        `timeout` (default the outage timeout). librdkafka re-sends on its own meanwhile."""
        limit = self.outage_s if timeout is None else timeout
        started = time.monotonic()
        warned = False
        stuck = _StuckDelivery(self._answers)
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
            if stuck.check(remaining):
                self._wedged = True
                raise Wedged(
                    f"flush: {remaining} records not acknowledged for {STUCK_S:.0f}s although the broker "
                    "answers (librdkafka lost their partition's leader); restart the stage"
                )
        self._fatal.check("flush")
        if remaining:
            raise KafkaError(f"{remaining} records not delivered within {limit:.0f}s (is the broker up?)")
        if warned:
            log.warning("flush: delivered after %.1fs", time.monotonic() - started)
        if self._errors:
            errors, self._errors = self._errors, []
            raise KafkaError(f"{len(errors)} records failed delivery; first: {errors[0]}")

    def _answers(self) -> bool:
        """A metadata request of this producer's own: whether the broker answers it (its answer
        also refreshes the leaders librdkafka knows)."""
        try:
            self._p.list_topics(timeout=2.0)
            return True
        except ck.KafkaException:
            return False

    def init_transactions(self, timeout: float = 30.0) -> None:
        try:
            self._p.init_transactions(timeout)
        except ck.KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if is_refusal(err):
                raise refusal(err, self._who, "WRITE", self._transactional_id or "") from exc
            raise fail("init_transactions", exc) from exc

    def begin_transaction(self) -> None:
        try:
            self._p.begin_transaction()
        except ck.KafkaException as exc:
            raise fail("begin_transaction", exc) from exc

    def _transaction_step(self, what: str, call: Callable[[float], None], timeout: float) -> None:
        """A transaction call, retried through an outage (librdkafka allows calling a timed-out
        send_offsets/commit again); a transaction that must be aborted is aborted and reported
        as `TransactionAborted`."""
        backoff = Backoff(what, self.outage_s)
        while True:
            try:
                bounded(what, call, min(timeout, max(backoff.left(), 1.0)))
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
                raise fail(what, exc) from exc

    def send_offsets_to_transaction(
        self, offsets: Mapping[TopicPartition, int], group_metadata: Any, timeout: float = TRANSACTION_CALL_S
    ) -> None:
        tps = [ck.TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        self._transaction_step(
            "send_offsets_to_transaction",
            lambda t: self._p.send_offsets_to_transaction(tps, group_metadata, t),
            timeout,
        )

    def commit_transaction(self, timeout: float = TRANSACTION_CALL_S) -> None:
        self._transaction_step("commit_transaction", self._p.commit_transaction, timeout)
        self._errors.clear()

    def abort_transaction(self, timeout: float = TRANSACTION_CALL_S) -> None:
        if self._wedged:
            raise Wedged("abort_transaction: the producer is wedged (an abandoned call); restart the stage")

        def call() -> None:
            bounded("abort_transaction", self._p.abort_transaction, timeout)

        retry(call, "abort_transaction", self.outage_s, fail)
        self._errors.clear()

    def close(self) -> None:
        """Send what is queued (5 s at most). A producer that failed for good (fenced by a newer
        instance of its transactional id, or another fatal error) can send nothing more, and the
        call that met the error has raised it already: closing logs it instead of raising over
        that error (from a stage's `finally`, a fenced producer's flush replaced the stage's
        one-line error with a traceback: seen in the hour under bench/nemesis.py)."""
        try:
            self._p.flush(5.0)
        except ck.KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], ck.KafkaError) else None
            if err is None or not err.fatal():
                raise
            log.warning(
                "%s: closed after a fatal error, nothing more sent: %s", self._fatal.client_id, err.str()
            )

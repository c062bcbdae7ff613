"""The consume-process-produce loop, written once: the verifier and the preprocessor run on it.

    poll a batch -> decode (undecodable/invalid -> DLQ) -> handle(batch) -> produce outputs
    -> at-least-once: flush, then commit the batch's offsets
    -> exactly-once:  produce and offsets in one Kafka transaction

Offsets are committed only after the outputs are acknowledged, so a crash re-processes
(at-least-once; downstream drops duplicates by id) or re-runs an aborted transaction
(exactly-once). SIGTERM drains: the batch in hand is finished and committed, then the loop
closes its clients. A broker outage is waited out (`stream_rl.kafka.outage`); a transaction
the outage forced to abort is redone: the consumer goes back to its committed offsets and the
stage's partition state is rebuilt (`on_revoke` then `on_assign` of the assignment), as after a
restart, so nothing is lost or emitted twice. Runs can be bounded by record count or idle time (tests drive real
stages to completion without sleeps).

Consumers that commit on another rule poll the same transport themselves (docs/concepts.md
"Design choices"): the actor (work completes out of order: `stream_rl.kafka.offsets.OffsetTracker`),
the trainer (commits after durable checkpoints) and the evaluator (follows `weight-versions`,
never commits).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from stream_rl.common import heap
from stream_rl.common.metrics import BATCH_SECONDS, RECORDS_IN, RECORDS_OUT
from stream_rl.contracts import Contract
from stream_rl.errors import ContractError, KafkaError, TransactionAborted
from stream_rl.kafka.dead_letters import DeadLetters
from stream_rl.kafka.serde import Serde, default_serde
from stream_rl.kafka.transport import Consumer, Message, Producer, TopicPartition, Transport

log = logging.getLogger(__name__)

T = TypeVar("T", bound=Contract)


class StopFlag:
    """Set by SIGTERM/SIGINT (or by a test); loops check it between batches."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str = "stop requested") -> None:
        self.reason = reason
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT set the flag (main thread only); a second SIGINT raises."""

        def handler(signum: int, _frame: Any) -> None:
            if self and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.set(f"received {signal.Signals(signum).name}")

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


@dataclass(slots=True)
class Incoming(Generic[T]):
    """A consumed record and its decoded value."""

    msg: Message
    value: T


@dataclass(slots=True)
class Output:
    """A record to produce. `value` is a contract object (encoded by the loop) or raw bytes."""

    topic: str
    value: Contract | bytes | None
    key: str | bytes | None = None
    headers: dict[str, str | bytes] | None = None
    partition: int | None = None


@dataclass(slots=True)
class Reject:
    """Returned by a handler for a record it cannot process: it goes to the DLQ with `reason`."""

    incoming: Incoming[Any]
    reason: str


def next_offsets(msgs: Iterable[Message]) -> dict[TopicPartition, int]:
    """The offsets to commit after processing `msgs`: last offset + 1 per partition."""
    out: dict[TopicPartition, int] = {}
    for m in msgs:
        if m.offset + 1 > out.get(m.tp, -1):
            out[m.tp] = m.offset + 1
    return out


@dataclass
class StageStats:
    records_in: int = 0
    records_out: int = 0
    dlq: int = 0
    batches: int = 0
    stopped_by: str = ""
    extra: dict[str, float] = field(default_factory=dict)


Handler = Callable[[list[Incoming[T]]], Iterable[Output | Reject]]


class StageLoop(Generic[T]):
    """One stage's loop over one input topic. See the module docstring."""

    def __init__(
        self,
        *,
        name: str,
        transport: Transport,
        group: str,
        input_topic: str,
        input_type: type[T],
        handle: Handler[T],
        dlq_topic: str | None,
        client_id: str | None = None,
        transactional_id: str | None = None,
        instance_id: str | None = None,
        serde: Serde | None = None,
        batch_size: int = 64,
        poll_timeout_s: float = 0.2,
        on_assign: Callable[[list[TopicPartition]], None] | None = None,
        on_revoke: Callable[[list[TopicPartition]], None] | None = None,
        on_idle: Callable[[], Iterable[Output | Reject]] | None = None,
        before_poll: Callable[[], None] | None = None,
        stop: StopFlag | None = None,
        linger_s: float = 0.0,
        commit_every_s: float = 0.0,
    ) -> None:
        """`linger_s`: after the first records of a poll, keep collecting up to `batch_size` for
        this long (fewer, larger transactions: each costs the broker ~2% of a core at 1/s).
        `commit_every_s` (at-least-once stages): commit offsets at most this often, not after every
        batch (each commit is a broker write; a crash redoes at most this much, and downstream
        drops the duplicates)."""
        self.name = name
        self.input_topic = input_topic
        self.input_type = input_type
        self.handle = handle
        self.dlq_topic = dlq_topic
        self.dead_letters = DeadLetters(name, dlq_topic)
        self.serde = serde or default_serde()
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self.on_idle = on_idle
        self.before_poll = before_poll
        self.stop = stop if stop is not None else StopFlag()
        self.linger_s = linger_s
        self.commit_every_s = commit_every_s
        self._uncommitted: dict[TopicPartition, int] = {}
        self._last_commit = 0.0
        self.transactional = transactional_id is not None
        self.stats = StageStats()
        client_id = client_id or name
        # A stable instance id (static membership) lets a restarted instance resume at once.
        self.consumer: Consumer = transport.consumer(group, client_id, instance_id or transactional_id)
        self.producer: Producer = transport.producer(client_id, transactional_id)
        self._user_on_assign = on_assign
        self._user_on_revoke = on_revoke
        if self.transactional:
            self.producer.init_transactions()

    # -- producing -------------------------------------------------------------------------
    def _produce(self, out: Output) -> None:
        value = out.value
        if value is not None and not isinstance(value, bytes):
            value = self.serde.encode(value)
        self.producer.produce(out.topic, value, key=out.key, headers=out.headers, partition=out.partition)
        RECORDS_OUT.labels(self.name, out.topic).inc()
        self.stats.records_out += 1

    def _to_dlq(self, msg: Message, error: str) -> None:
        self.dead_letters.write(self.producer, msg, error)
        self.stats.dlq += 1

    def _emit(self, results: Iterable[Output | Reject]) -> None:
        for r in results:
            if isinstance(r, Reject):
                self._to_dlq(r.incoming.msg, r.reason)
            else:
                try:
                    self._produce(r)
                except ContractError as exc:
                    # Our own output broke its contract: a bug, not bad input. Fail loudly.
                    raise ContractError(f"{self.name} produced an invalid {r.topic} record: {exc}") from exc

    # -- one batch -------------------------------------------------------------------------
    def _decode(self, msgs: Sequence[Message]) -> list[Incoming[T]]:
        good: list[Incoming[T]] = []
        for m in msgs:
            RECORDS_IN.labels(self.name, m.topic).inc()
            try:
                good.append(Incoming(m, self.serde.decode(m.value, self.input_type)))
            except ContractError as exc:
                self._to_dlq(m, str(exc))
        return good

    def _process(self, msgs: list[Message]) -> None:
        started = time.perf_counter()
        if self.transactional:
            self.producer.begin_transaction()
            try:
                self._emit(self.handle(self._decode(msgs)))
                self.producer.send_offsets_to_transaction(next_offsets(msgs), self.consumer.group_metadata())
                self.producer.commit_transaction()
            except TransactionAborted as exc:
                self._rewind(str(exc), msgs)
                return
            except BaseException:
                self._abort()
                raise
        else:
            self._emit(self.handle(self._decode(msgs)))
            self.producer.flush()
            self._uncommitted.update(next_offsets(msgs))
            self._commit(force=self.commit_every_s <= 0)
        self.stats.records_in += len(msgs)
        self.stats.batches += 1
        BATCH_SECONDS.labels(self.name).observe(time.perf_counter() - started)

    def _commit(self, force: bool = False) -> None:
        """Commit what is flushed (at-least-once), at most every `commit_every_s` unless forced."""
        if not self._uncommitted or (
            not force and time.monotonic() - self._last_commit < self.commit_every_s
        ):
            return
        offsets, self._uncommitted = self._uncommitted, {}
        self.consumer.commit(offsets)
        self._last_commit = time.monotonic()

    def _on_assign(self, partitions: list[TopicPartition]) -> None:
        log.info("%s: partitions %s assigned", self.name, sorted(p for _t, p in partitions))
        if self._user_on_assign:
            self._user_on_assign(partitions)

    def _on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Commit the revoked partitions' flushed offsets first (their next owner starts there)."""
        mine = {tp: o for tp, o in self._uncommitted.items() if tp in set(partitions)}
        if mine:
            try:
                self.consumer.commit(mine)
            except KafkaError as exc:  # lost, not revoked: the next owner redoes them
                log.warning("%s: commit on revocation failed: %s", self.name, exc)
            for tp in mine:
                self._uncommitted.pop(tp, None)
        if self._user_on_revoke:
            self._user_on_revoke(partitions)

    def _poll(self, want: int) -> list[Message]:
        msgs = self.consumer.poll_batch(want, self.poll_timeout_s)
        if msgs and self.linger_s > 0 and len(msgs) < want:
            deadline = time.monotonic() + self.linger_s
            while len(msgs) < want and not self.stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                msgs.extend(self.consumer.poll_batch(want - len(msgs), left))
        return msgs

    def _rewind(self, why: str, msgs: Sequence[Message] = ()) -> None:
        """After an aborted transaction: the batch's partitions go back to the batch's first offsets
        (every earlier batch was committed; asking the group coordinator instead can block for good
        right after a broker restart, since the consumer is not polled meanwhile), and the stage's
        partition state is rebuilt from its own durable state."""
        parts = self.consumer.assignment()
        log.warning("%s: %s: redoing the batch (%d records)", self.name, why, len(msgs))
        self.stats.extra["transactions_redone"] = self.stats.extra.get("transactions_redone", 0.0) + 1
        first: dict[TopicPartition, int] = {}
        for m in msgs:
            first[m.tp] = min(first.get(m.tp, m.offset), m.offset)
        for tp, offset in first.items():
            self.consumer.seek(tp, offset)
        if self._user_on_revoke:
            self._user_on_revoke(parts)
        if self._user_on_assign:
            self._user_on_assign(parts)

    def _abort(self) -> None:
        try:
            self.producer.abort_transaction()
        except Exception as exc:  # noqa: BLE001 - the original error is the one to report
            log.error("%s: abort_transaction failed: %s", self.name, exc)

    def _idle(self) -> None:
        if self.on_idle is None:
            return
        if self.transactional:
            results = list(self.on_idle())
            if not results:
                return  # no transaction for nothing (an idle stage polls several times a second)
            self.producer.begin_transaction()
            try:
                self._emit(results)
                self.producer.commit_transaction()
            except TransactionAborted as exc:
                self._rewind(str(exc))
            except BaseException:
                self._abort()
                raise
        else:
            self._emit(self.on_idle())
            self.producer.flush()

    # -- the loop --------------------------------------------------------------------------
    def run(self, max_records: int | None = None, idle_timeout_s: float | None = None) -> StageStats:
        """Run until stopped, `max_records` consumed, or `idle_timeout_s` without input."""
        self.consumer.subscribe([self.input_topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
        heap.settle()
        last_input = time.monotonic()
        try:
            while not self.stop:
                if max_records is not None and self.stats.records_in >= max_records:
                    self.stats.stopped_by = "max_records"
                    break
                if self.before_poll:
                    self.before_poll()
                want = self.batch_size
                if max_records is not None:
                    want = min(want, max_records - self.stats.records_in)
                msgs = self._poll(want)
                if msgs:
                    self._process(msgs)
                    last_input = time.monotonic()
                    continue
                self._idle()
                self._commit()
                if idle_timeout_s is not None and time.monotonic() - last_input >= idle_timeout_s:
                    self.stats.stopped_by = "idle_timeout"
                    break
            else:
                self.stats.stopped_by = self.stop.reason or "stopped"
        finally:
            self.close()
        return self.stats

    def close(self) -> None:
        try:
            self.producer.close()
            if self._uncommitted:
                self._commit(force=True)  # flushed output: its input offsets (drain)
        finally:
            self.consumer.close()

"""`read_to_end(settle_s=...)` against a real broker: a transaction undecided when the read starts
is waited for and its records are read; one held open past the bound is a one-line error.

The preprocessor rebuilds a partition's groups this way when it takes the partition over: the
previous owner's last commit may have returned with its markers not yet written, and a read to
the last stable offset would miss its records (a clean-clone CI run read 16 of 24 samples right
after a preprocessor's last commit). Its rebuild is driven here the same way: the previous
owner's open group, committed after the rebuild began, is rebuilt; a transaction that no one
decides is one line naming `stream-rl hanging`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from fakes.records import make_partial_group
from stage_helpers import make_config

from stream_rl.errors import KafkaError
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.stage import StopFlag
from stream_rl.kafka.topics import TRAINING_BATCHES, TopicNames
from stream_rl.stages import preprocessor

pytestmark = pytest.mark.integration


class _Watching:
    """The transport, with an event set at the reader's first read of the committed ends."""

    def __init__(self, inner: KafkaTransport) -> None:
        self.inner = inner
        self.asked = threading.Event()

    def watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        got = self.inner.watermarks(topic)
        self.asked.set()
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _open_transaction(
    kafka: KafkaTransport,
    topic: str,
    tid: str,
    value: bytes = b"decided after the read began",
    key: bytes = b"k",
) -> Any:
    producer = kafka.producer("settle-test", transactional_id=tid)
    producer.init_transactions()
    producer.begin_transaction()
    producer.produce(topic, value, key=key, partition=0)
    producer.flush()  # in the log (the log end moves), not yet decided
    return producer


R = TypeVar("R")


def _commit_once_asked(watching: _Watching, producer: Any, read: Callable[[], R]) -> R:
    """`read()` on a thread; the open transaction committed once it has read the committed ends
    (so after the read began); what it returned, or what it raised, raised here."""
    got: list[R | BaseException] = []

    def target() -> None:
        try:
            got.append(read())
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread below
            got.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert watching.asked.wait(30), "the read never read the committed ends"
    producer.commit_transaction()
    thread.join(60)
    assert not thread.is_alive() and got, "the read did not end within 60 s of the commit"
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


def _undecided(kafka: KafkaTransport, topic: str) -> bool:
    """Partition 0's record is in the log while a read_committed reader's end stops before it."""
    return kafka.log_ends(topic)[0] > kafka.watermarks(topic)[0][1]


def test_a_transaction_undecided_when_the_read_starts_is_read_once_committed(
    kafka: KafkaTransport, run_names: TopicNames
) -> None:
    topic = run_names[TRAINING_BATCHES]
    producer = _open_transaction(kafka, topic, f"settle-{run_names.run}")
    try:
        # The fault: the record is in the log, and a read_committed reader's end stops before it.
        assert _undecided(kafka, topic)
        watching = _Watching(kafka)
        got = _commit_once_asked(
            watching, producer, lambda: list(read_to_end(watching, topic, [0], settle_s=60))
        )
    finally:
        producer.close()
    # Without the settling, the reader's ends were those before the commit: it read nothing.
    assert [m.value for m in got] == [b"decided after the read began"]


def test_a_transaction_held_open_past_the_bound_is_one_line(
    kafka: KafkaTransport, run_names: TopicNames
) -> None:
    topic = run_names[TRAINING_BATCHES]
    producer = _open_transaction(kafka, topic, f"settle-open-{run_names.run}")
    try:
        with pytest.raises(
            KafkaError, match=rf"{topic}: a transaction is still undecided after 1s .*holds it open"
        ):
            list(read_to_end(kafka, topic, [0], settle_s=1))
        assert _undecided(kafka, topic)  # still open: the fault held
    finally:
        producer.abort_transaction()
        producer.close()


def _previous_owner(kafka: KafkaTransport, names: TopicNames, tid: str) -> tuple[Any, str]:
    """(its producer, the group id): another preprocessor instance's last transaction on state
    partition 0, an open group of 2 samples, in the log and not yet decided."""
    group = make_partial_group(0, received=2)
    value = default_serde().encode(group)
    return _open_transaction(
        kafka, names["preprocessor-state"], tid, value, group.group_id.encode()
    ), group.group_id


def test_the_preprocessor_rebuilds_the_previous_owners_commit_undecided_when_it_starts(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str
) -> None:
    producer, group_id = _previous_owner(
        kafka, run_names, f"{run_names.prefix}.{run_names.run}.preprocessor.old"
    )
    try:
        assert _undecided(kafka, run_names["preprocessor-state"])  # the fault: not yet decided
        watching = _Watching(kafka)
        pre = preprocessor.Preprocessor(make_config(run_names, kafka_bootstrap), watching, StopFlag(), 1)
        watching.asked.clear()  # (its constructor reads the ends too)
        groups = _commit_once_asked(watching, producer, lambda: pre.rebuild(0))
    finally:
        producer.close()
    # Without the wait, the rebuild read to the last stable offset before the commit: no group.
    assert list(groups.open) == [group_id] and len(groups.open[group_id].samples) == 2


def test_a_state_transaction_no_one_decides_stops_the_rebuild_with_one_line(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(preprocessor, "REBUILD_SETTLE_S", 1.0)
    producer, _group_id = _previous_owner(
        kafka, run_names, f"{run_names.prefix}.{run_names.run}.preprocessor.held"
    )
    try:
        pre = preprocessor.Preprocessor(make_config(run_names, kafka_bootstrap), kafka, StopFlag(), 1)
        with pytest.raises(KafkaError) as caught:
            pre.rebuild(0)
        assert _undecided(kafka, run_names["preprocessor-state"])  # still open: the fault held
    finally:
        producer.abort_transaction()
        producer.close()
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith("preprocessor-1: partition 0's state cannot be rebuilt: ")
    assert "still undecided after 1s" in line
    assert f"`stream-rl hanging --run {run_names.run} --config <the run's config> --abort` ends it" in line

"""`read_to_end(settle_s=...)` against a real broker: a transaction undecided when the read starts
is waited for and its records are read; one held open past the bound is a one-line error.

The preprocessor rebuilds a partition's groups this way when it takes the partition over: the
previous owner's last commit may have returned with its markers not yet written, and a read to
the last stable offset would miss its records (a clean-clone CI run read 16 of 24 samples right
after a preprocessor's last commit)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from stream_rl.errors import KafkaError
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.topics import TRAINING_BATCHES, TopicNames
from stream_rl.kafka.transport import Message

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


def _open_transaction(kafka: KafkaTransport, topic: str, tid: str) -> Any:
    producer = kafka.producer("settle-test", transactional_id=tid)
    producer.init_transactions()
    producer.begin_transaction()
    producer.produce(topic, b"decided after the read began", key=b"k", partition=0)
    producer.flush()  # in the log (the log end moves), not yet decided
    return producer


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
        got: list[Message] = []
        reader = threading.Thread(
            target=lambda: got.extend(read_to_end(watching, topic, [0], settle_s=60)),  # type: ignore[arg-type]
            daemon=True,
        )
        reader.start()
        assert watching.asked.wait(30), "the reader never read the committed ends"
        producer.commit_transaction()  # after the reader began
        reader.join(60)
        assert not reader.is_alive()
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

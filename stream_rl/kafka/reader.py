"""Read partitions of a topic from their start to their current end (read_committed), outside any
consumer group: the loader's idempotence check and the preprocessor's state rebuild use it."""

from __future__ import annotations

import time
from collections.abc import Iterator

from stream_rl.errors import KafkaError
from stream_rl.kafka.transport import Message, Transport


def read_to_end(
    transport: Transport,
    topic: str,
    partitions: list[int] | None = None,
    *,
    client_id: str = "stream-rl-reader",
    batch: int = 500,
    timeout_s: float = 60.0,
    start: dict[int, int] | None = None,
    marks: dict[int, tuple[int, int]] | None = None,
    settle_s: float | None = None,
) -> Iterator[Message]:
    """Yield every committed record of `partitions` (all when None) up to the end offsets seen at
    the call (or `marks`, watermarks the caller read), in offset order per partition, from `start`
    where given (a partition's next offset to read; never below its low watermark). Raises
    KafkaError if the end is not reached in time.

    With `settle_s`, first wait (at most that long) until every transaction in the log at the call
    is decided and marked (`settled`): the reader then sees every commit that returned before it."""
    if settle_s is not None and marks is None:
        settled(transport, topic, partitions, settle_s)
    marks = marks if marks is not None else transport.watermarks(topic)
    wanted = {p: marks[p] for p in (partitions if partitions is not None else sorted(marks))}
    begin = {p: max(low, (start or {}).get(p, low)) for p, (low, _high) in wanted.items()}
    ends = {(topic, p): high for p, (_low, high) in wanted.items() if high > begin[p]}
    if not ends:
        return
    consumer = transport.consumer(None, client_id)
    try:
        consumer.assign({(topic, p): begin[p] for p in wanted if (topic, p) in ends})
        deadline = time.monotonic() + timeout_s
        while True:
            for msg in consumer.poll_batch(batch, 0.2):
                if msg.offset < ends[msg.tp]:
                    yield msg
            # The position passes transaction markers and compacted gaps the records do not show.
            position = consumer.position()
            if all(position.get(tp, -1) >= end for tp, end in ends.items()):
                return
            if time.monotonic() > deadline:
                behind = {tp: (position.get(tp), end) for tp, end in ends.items()}
                raise KafkaError(f"reading {topic} to its end timed out after {timeout_s}s: {behind}")
    finally:
        consumer.close()


class Unsettled(KafkaError):
    """A transaction in the log stayed undecided past the bound (`settled`)."""


def settled(transport: Transport, topic: str, partitions: list[int] | None, timeout_s: float) -> None:
    """Wait until each partition's last stable offset (the end a read_committed reader is given)
    reaches its log's end as it is now, i.e. every transaction already in the log is decided and
    its markers written. A transactional commit returns once the coordinator has logged the
    decision; the markers reach the partitions after that, so a read right after another
    producer's commit can stop short of that commit's records. Raises KafkaError naming the
    partitions after `timeout_s` (a transaction held open that long): `Unsettled`."""
    ends = transport.log_ends(topic)
    wanted = {p: ends[p] for p in (partitions if partitions is not None else ends)}
    deadline = time.monotonic() + timeout_s
    while True:
        stable = transport.watermarks(topic)
        short = {p: (stable[p][1], end) for p, end in wanted.items() if stable[p][1] < end}
        if not short:
            return
        if time.monotonic() > deadline:
            raise Unsettled(
                f"{topic}: a transaction is still undecided after {timeout_s:g}s (partition: "
                f"(last stable offset, log end) {short}); another producer holds it open"
            )
        time.sleep(0.02)

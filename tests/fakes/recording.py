"""An in-memory transport that records which topics its clients touch: what they produce to,
what they consume in a consumer group (subscribe or assign), and what they read without one
(followers). One transport per stage under test, so everything recorded is that stage's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stream_rl.kafka.memory import MemoryConsumer, MemoryProducer, MemoryTransport
from stream_rl.kafka.transport import Headers, RebalanceCallback, TopicPartition


@dataclass
class Touched:
    produced: set[str] = field(default_factory=set)
    consumed: dict[str, set[str]] = field(default_factory=dict)
    """group -> topics."""
    followed: set[str] = field(default_factory=set)


class RecordingProducer(MemoryProducer):
    def __init__(self, transport: RecordingTransport, transactional_id: str | None) -> None:
        super().__init__(transport.broker, transactional_id)
        self._touched = transport.touched

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | str | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> None:
        self._touched.produced.add(topic)
        super().produce(topic, value, key=key, headers=headers, partition=partition)


class RecordingConsumer(MemoryConsumer):
    def __init__(self, transport: RecordingTransport, group_id: str | None) -> None:
        super().__init__(transport.broker, group_id)
        self._touched = transport.touched

    def _note(self, topics: list[str]) -> None:
        if self.group_id is None:
            self._touched.followed.update(topics)
        else:
            self._touched.consumed.setdefault(self.group_id, set()).update(topics)

    def subscribe(
        self,
        topics: list[str],
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
    ) -> None:
        self._note(topics)
        super().subscribe(topics, on_assign=on_assign, on_revoke=on_revoke)

    def assign(self, offsets: Mapping[TopicPartition, int]) -> None:
        self._note(sorted({t for t, _p in offsets}))
        super().assign(offsets)


class RecordingTransport(MemoryTransport):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.touched = Touched()

    def producer(self, client_id: str, transactional_id: str | None = None) -> MemoryProducer:
        return RecordingProducer(self, transactional_id)

    def consumer(
        self, group_id: str | None, client_id: str, instance_id: str | None = None
    ) -> MemoryConsumer:
        return RecordingConsumer(self, group_id)

    def forget(self) -> None:
        """Drop what was recorded so far (the test's own setup writes)."""
        self.touched = Touched()

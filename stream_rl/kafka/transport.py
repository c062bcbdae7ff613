"""The narrow producer/consumer interface every stage is written against.

Two implementations: `stream_rl.kafka.confluent.KafkaTransport` (confluent-kafka, the real broker)
and `stream_rl.kafka.memory.MemoryTransport` (unit tests only). Stages receive a transport;
none is global.

Semantics both implementations share:
- Offsets are "next offset to consume". Commits are synchronous.
- Consumers read committed data only (transactions: read_committed).
- Rebalance callbacks are incremental (cooperative): `on_assign(added)`, `on_revoke(removed)`.
- `Producer.flush()` raises `KafkaError` if any record since the last flush was not delivered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

TopicPartition = tuple[str, int]
RebalanceCallback = Callable[[list[TopicPartition]], None]
Headers = Mapping[str, str | bytes]


@dataclass(slots=True)
class Message:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    timestamp_ms: int = 0

    @property
    def tp(self) -> TopicPartition:
        return (self.topic, self.partition)

    def header(self, name: str) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


class Producer(Protocol):
    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | str | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> None: ...

    def flush(self, timeout: float | None = None) -> None: ...

    def init_transactions(self, timeout: float = 30.0) -> None: ...

    def begin_transaction(self) -> None: ...

    def send_offsets_to_transaction(
        self, offsets: Mapping[TopicPartition, int], group_metadata: Any, timeout: float = 30.0
    ) -> None: ...

    def commit_transaction(self, timeout: float = 30.0) -> None: ...

    def abort_transaction(self, timeout: float = 30.0) -> None: ...

    def close(self) -> None: ...


class Consumer(Protocol):
    def subscribe(
        self,
        topics: list[str],
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
    ) -> None: ...

    def assign(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Read these partitions from these offsets, outside any group (followers, replay)."""
        ...

    def poll_batch(self, max_records: int, timeout: float) -> list[Message]: ...

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None: ...

    def committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """Committed offsets of this consumer's group (-1 where none)."""
        ...

    def position(self) -> dict[TopicPartition, int]:
        """Next offset to read of every assigned partition."""
        ...

    def seek(self, tp: TopicPartition, offset: int) -> None: ...

    def assignment(self) -> list[TopicPartition]: ...

    def pause(self, partitions: list[TopicPartition]) -> None:
        """Stop fetching these partitions (their position stays) until `resume`."""
        ...

    def resume(self, partitions: list[TopicPartition]) -> None: ...

    def end_offset(self, tp: TopicPartition) -> int:
        """The partition's end offset as last seen by this consumer's fetches (-1: not known yet)."""
        ...

    def group_metadata(self) -> Any: ...

    def close(self) -> None: ...


class Transport(Protocol):
    def producer(self, client_id: str, transactional_id: str | None = None) -> Producer: ...

    def consumer(self, group_id: str | None, client_id: str, instance_id: str | None = None) -> Consumer:
        """A consumer in `group_id` (None: assign-only, never commits). `instance_id` makes it a
        static group member: a restarted instance with the same id takes its partitions back at
        once instead of waiting for the session timeout of its dead predecessor."""
        ...

    def watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        """(low, high) offsets of every partition of a topic (high = end, read_committed)."""
        ...

    def log_ends(self, topic: str) -> dict[int, int]:
        """The end of every partition's log, records of undecided transactions included
        (read_uncommitted): `watermarks`' high stays below it while a transaction is open, or is
        decided and its markers are not yet written."""
        ...

    def group_offsets(self, group_id: str, topic: str) -> dict[int, int]:
        """Committed offsets of a group on every partition of a topic (-1 where none)."""
        ...

    def list_topic_names(self) -> list[str]:
        """The names of the topics that exist."""
        ...

    def group_members(self, group_id: str) -> int:
        """Live members of a consumer group (0 when the group has none or does not exist)."""
        ...

    def create_topics(
        self,
        topics: list[tuple[str, int, dict[str, str]]],
        replication_factors: Mapping[str, int] | None = None,
    ) -> list[str]:
        """Create topics that do not exist yet, each with its replication factor (default 1);
        returns the names created."""
        ...

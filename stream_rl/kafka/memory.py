"""An in-memory transport with the semantics of `transport.py`, for unit tests only.

Partitions are lists; consumer groups get partitions round-robin over their members in join
order; transactions buffer records and offsets until commit. Integration tests use the real
broker instead.
"""

from __future__ import annotations

import itertools
import threading
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stream_rl.errors import KafkaError
from stream_rl.kafka.transport import Headers, Message, RebalanceCallback, TopicPartition


@dataclass
class _Member:
    consumer: MemoryConsumer
    topics: list[str]


@dataclass
class _Group:
    members: list[_Member] = field(default_factory=list)
    committed: dict[TopicPartition, int] = field(default_factory=dict)


class MemoryBroker:
    def __init__(self, brokers: int = 1) -> None:
        self.brokers = brokers
        """How many brokers this cluster pretends to have (bounds replication factors)."""
        self.topics: dict[str, list[list[Message]]] = {}
        self.configs: dict[str, dict[str, str]] = {}
        self.replication: dict[str, int] = {}
        self.groups: dict[str, _Group] = {}
        self.cond = threading.Condition()
        self._rr = itertools.count()

    def create(self, name: str, partitions: int) -> bool:
        with self.cond:
            if name in self.topics:
                return False
            self.topics[name] = [[] for _ in range(partitions)]
            return True

    def _partition_for(self, topic: str, key: bytes | None, partition: int | None) -> int:
        parts = self.topics[topic]
        if partition is not None:
            if not 0 <= partition < len(parts):
                raise KafkaError(f"{topic} has no partition {partition}")
            return partition
        if key is None:
            return next(self._rr) % len(parts)
        return zlib.crc32(key) % len(parts)

    def append(
        self, records: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]], int | None]]
    ) -> None:
        with self.cond:
            for topic, key, value, headers, partition in records:
                if topic not in self.topics:
                    raise KafkaError(f"topic {topic} does not exist (run `stream-rl topics apply` first)")
                p = self._partition_for(topic, key, partition)
                log = self.topics[topic][p]
                log.append(Message(topic, p, len(log), key, value, headers, int(time.time() * 1000)))
            self.cond.notify_all()

    def commit(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        with self.cond:
            self.groups.setdefault(group, _Group()).committed.update(offsets)

    def rebalance(self, group_id: str) -> None:
        """Round-robin the group's topics' partitions over its members; notify the changes."""
        group = self.groups[group_id]
        parts: list[TopicPartition] = []
        for topic in sorted({t for m in group.members for t in m.topics}):
            parts.extend((topic, p) for p in range(len(self.topics.get(topic, []))))
        new: dict[int, list[TopicPartition]] = {id(m): [] for m in group.members}
        for i, tp in enumerate(parts):
            new[id(group.members[i % len(group.members)])].append(tp)
        for m in group.members:
            m.consumer._reassign(new[id(m)])


class MemoryProducer:
    def __init__(self, broker: MemoryBroker, transactional_id: str | None) -> None:
        self.broker = broker
        self.transactional_id = transactional_id
        self._txn: list[Any] | None = None
        self._txn_offsets: tuple[str, dict[TopicPartition, int]] | None = None

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | str | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> None:
        k = key.encode() if isinstance(key, str) else key
        hs = [(n, v.encode() if isinstance(v, str) else v) for n, v in (headers or {}).items()]
        rec = (topic, k, value, hs, partition)
        if self._txn is not None:
            self._txn.append(rec)
        else:
            if self.transactional_id:
                raise KafkaError("transactional producer: produce outside a transaction")
            self.broker.append([rec])

    def flush(self, timeout: float | None = None) -> None:
        return None

    def init_transactions(self, timeout: float = 30.0) -> None:
        if not self.transactional_id:
            raise KafkaError("init_transactions on a non-transactional producer")

    def begin_transaction(self) -> None:
        if self._txn is not None:
            raise KafkaError("a transaction is already open")
        self._txn, self._txn_offsets = [], None

    def send_offsets_to_transaction(
        self, offsets: Mapping[TopicPartition, int], group_metadata: Any, timeout: float = 30.0
    ) -> None:
        if self._txn is None:
            raise KafkaError("send_offsets_to_transaction outside a transaction")
        self._txn_offsets = (str(group_metadata), dict(offsets))

    def commit_transaction(self, timeout: float = 30.0) -> None:
        if self._txn is None:
            raise KafkaError("commit without an open transaction")
        self.broker.append(self._txn)
        if self._txn_offsets:
            self.broker.commit(*self._txn_offsets)
        self._txn, self._txn_offsets = None, None

    def abort_transaction(self, timeout: float = 30.0) -> None:
        self._txn, self._txn_offsets = None, None

    def close(self) -> None:
        self._txn = None


class MemoryConsumer:
    def __init__(self, broker: MemoryBroker, group_id: str | None) -> None:
        self.broker = broker
        self.group_id = group_id
        self._positions: dict[TopicPartition, int] = {}
        self._pending: list[tuple[list[TopicPartition], list[TopicPartition]]] = []
        self._on_assign: RebalanceCallback | None = None
        self._on_revoke: RebalanceCallback | None = None
        self._closed = False
        self._paused: set[TopicPartition] = set()

    # called by the broker with its lock held
    def _reassign(self, parts: list[TopicPartition]) -> None:
        old = set(self._positions) | {tp for _, added in self._pending for tp in added}
        added = [tp for tp in parts if tp not in old]
        removed = [tp for tp in old if tp not in parts]
        if added or removed:
            self._pending.append((removed, added))

    def subscribe(
        self,
        topics: list[str],
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
    ) -> None:
        if self.group_id is None:
            raise KafkaError("subscribe needs a consumer group")
        self._on_assign, self._on_revoke = on_assign, on_revoke
        with self.broker.cond:
            for t in topics:
                if t not in self.broker.topics:
                    raise KafkaError(f"topic {t} does not exist (run `stream-rl topics apply` first)")
            group = self.broker.groups.setdefault(self.group_id, _Group())
            group.members.append(_Member(self, list(topics)))
            self.broker.rebalance(self.group_id)

    def assign(self, offsets: Mapping[TopicPartition, int]) -> None:
        with self.broker.cond:
            self._positions = dict(offsets)

    def _apply_rebalances(self) -> None:
        while True:
            with self.broker.cond:
                if not self._pending:
                    return
                removed, added = self._pending.pop(0)
            if removed:
                if self._on_revoke:
                    self._on_revoke(removed)
                for tp in removed:
                    self._positions.pop(tp, None)
            if added:
                committed = self.committed(added)
                for tp in added:
                    self._positions[tp] = max(committed.get(tp, -1), 0)
                if self._on_assign:
                    self._on_assign(added)

    def poll_batch(self, max_records: int, timeout: float) -> list[Message]:
        self._apply_rebalances()
        deadline = time.monotonic() + timeout
        with self.broker.cond:
            while True:
                out: list[Message] = []
                for tp, pos in self._positions.items():
                    if tp in self._paused:
                        continue
                    log = self.broker.topics[tp[0]][tp[1]]
                    take = log[pos : pos + max_records - len(out)]
                    out.extend(take)
                    self._positions[tp] = pos + len(take)
                    if len(out) >= max_records:
                        break
                if out:
                    return out
                left = deadline - time.monotonic()
                if left <= 0 or self._pending:
                    return []
                self.broker.cond.wait(left)

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        if self.group_id is None:
            raise KafkaError("commit needs a consumer group")
        self.broker.commit(self.group_id, offsets)

    def committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        with self.broker.cond:
            group = self.broker.groups.get(self.group_id or "", _Group())
            return {tp: group.committed.get(tp, -1) for tp in partitions}

    def position(self) -> dict[TopicPartition, int]:
        return dict(self._positions)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._positions[tp] = max(offset, 0)  # negative: librdkafka's logical "beginning"

    def assignment(self) -> list[TopicPartition]:
        return list(self._positions)

    def pause(self, partitions: list[TopicPartition]) -> None:
        self._paused.update(partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self._paused.difference_update(partitions)

    def end_offset(self, tp: TopicPartition) -> int:
        with self.broker.cond:
            return len(self.broker.topics[tp[0]][tp[1]])

    def group_metadata(self) -> Any:
        return self.group_id

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.group_id is None:
            return
        with self.broker.cond:
            group = self.broker.groups.get(self.group_id)
            if group:
                group.members = [m for m in group.members if m.consumer is not self]
                if group.members:
                    self.broker.rebalance(self.group_id)
                self.broker.cond.notify_all()


class MemoryTransport:
    def __init__(self, broker: MemoryBroker | None = None) -> None:
        self.broker = broker or MemoryBroker()

    def producer(self, client_id: str, transactional_id: str | None = None) -> MemoryProducer:
        return MemoryProducer(self.broker, transactional_id)

    def consumer(
        self, group_id: str | None, client_id: str, instance_id: str | None = None
    ) -> MemoryConsumer:
        return MemoryConsumer(self.broker, group_id)

    def watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        with self.broker.cond:
            return {p: (0, len(log)) for p, log in enumerate(self.broker.topics[topic])}

    def log_ends(self, topic: str) -> dict[int, int]:
        # A transaction's records enter the log at its commit: nothing is ever undecided here.
        return {p: high for p, (_low, high) in self.watermarks(topic).items()}

    def group_offsets(self, group_id: str, topic: str) -> dict[int, int]:
        with self.broker.cond:
            group = self.broker.groups.get(group_id, _Group())
            n = len(self.broker.topics[topic])
            return {p: group.committed.get((topic, p), -1) for p in range(n)}

    def group_members(self, group_id: str) -> int:
        with self.broker.cond:
            group = self.broker.groups.get(group_id)
            return len(group.members) if group else 0

    def create_topics(
        self,
        topics: list[tuple[str, int, dict[str, str]]],
        replication_factors: Mapping[str, int] | None = None,
    ) -> list[str]:
        created = []
        for name, parts, conf in topics:
            rf = (replication_factors or {}).get(name, 1)
            if rf > self.broker.brokers:
                raise KafkaError(
                    f"create topic {name}: replication factor {rf} larger than {self.broker.brokers} brokers"
                )
            if self.broker.create(name, parts):
                self.broker.configs[name] = dict(conf)
                self.broker.replication[name] = rf
                created.append(name)
        return created

    # -- the admin calls of `topics apply` (as KafkaTransport's) --------------------------------
    def list_topic_names(self) -> list[str]:
        with self.broker.cond:
            return sorted(self.broker.topics)

    def partitions(self, topic: str) -> list[int]:
        with self.broker.cond:
            return list(range(len(self.broker.topics[topic])))

    def topic_configs(self, topics: list[str]) -> dict[str, dict[str, str]]:
        return {t: dict(self.broker.configs.get(t, {})) for t in topics}

    def replication_factor(self, topic: str) -> int:
        return self.broker.replication.get(topic, 1)

    def broker_count(self) -> int:
        return self.broker.brokers

    def messages(self, topic: str) -> list[Message]:
        """Every record of a topic, partition by partition (test helper)."""
        with self.broker.cond:
            return [m for log in self.broker.topics[topic] for m in log]

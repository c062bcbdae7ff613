"""Commit points for work that completes out of order (the actor: a problem's group finishes
whenever its samples do), on any transport."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from stream_rl.errors import KafkaError
from stream_rl.kafka.transport import Message, TopicPartition


class OffsetTracker:
    """Commit bookkeeping for out-of-order completion: offsets become committable only when
    every earlier offset of the partition is done. `committable()` returns, per partition,
    the next offset after the longest done prefix."""

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, dict[int, bool]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._lock = threading.Lock()

    def started(self, msg: Message) -> None:
        with self._lock:
            self._pending.setdefault(msg.tp, {})[msg.offset] = False
            self._next.setdefault(msg.tp, msg.offset)

    def tracks(self, msg: Message) -> bool:
        """Was `msg` started and not forgotten (its partition not revoked since)?"""
        with self._lock:
            return msg.offset in self._pending.get(msg.tp, {})

    def done(self, msg: Message) -> None:
        with self._lock:
            part = self._pending.get(msg.tp)
            if part is None or msg.offset not in part:
                raise KafkaError(f"offset {msg.offset} of {msg.tp} was never started")
            part[msg.offset] = True

    def committable(self) -> dict[TopicPartition, int]:
        """Advance over done offsets and return the new commit points (only those that moved)."""
        out: dict[TopicPartition, int] = {}
        with self._lock:
            for tp, part in self._pending.items():
                moved = False
                for off in sorted(part):
                    if not part[off]:
                        break
                    del part[off]
                    self._next[tp] = off + 1
                    moved = True
                if moved:
                    out[tp] = self._next[tp]
        return out

    def in_flight(self) -> int:
        with self._lock:
            return sum(1 for part in self._pending.values() for done in part.values() if not done)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Drop the bookkeeping of revoked partitions (their work will be redone elsewhere)."""
        with self._lock:
            for tp in partitions:
                self._pending.pop(tp, None)
                self._next.pop(tp, None)

"""The order in which the actor takes problems: the loader's plan order, across partitions.

The loader writes its plan (every problem once per epoch, each epoch shuffled) round-robin over
the partitions of `problems`, each record with a `seq` header (its position in the plan). A
consumer reads each partition in order, but librdkafka hands over whole fetches of one partition
at a time, so an actor that took records as they came drained one partition (all its epochs)
before the next: 80 steps of a 1,000-problem run trained 324 problems 4-5 times each.

`ProblemOrder` keeps a small FIFO per assigned partition and hands out the head with the lowest
`seq`, waiting while an assigned partition that still has records has none buffered (the actor
keeps polling; partitions whose FIFO is full are paused so that the others are fetched).

- **One actor** (every partition assigned): problems are taken exactly in plan order, so epoch
  e + 1 of any problem is taken only after epoch e of every problem.
- **Several actors**: each takes its own partitions in plan order; partitions hold interleaved
  slices of the plan, so each actor walks the epochs at its own pace and the epochs stay aligned
  across actors as closely as their speeds (which the shared admission bound keeps close). A
  group taken by one actor while another is still finishing the previous epoch can get ahead by
  up to the actors' speed difference; nothing is taken twice or skipped.
- Records without a `seq` header (written by hand, or by an older loader) come after those with
  one, in arrival order. While the loader is still writing, a partition it has not reached yet
  counts as exhausted (nothing to wait for).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from stream_rl.contracts import Problem
from stream_rl.kafka.transport import Consumer, Message, TopicPartition

SEQ_HEADER = "seq"
NO_SEQ = 1 << 62


def seq_of(msg: Message) -> int:
    raw = msg.header(SEQ_HEADER)
    try:
        return int(raw) if raw is not None else NO_SEQ
    except ValueError:
        return NO_SEQ


class ProblemOrder:
    def __init__(self, per_partition: int = 8) -> None:
        self.per_partition = per_partition
        self._queues: dict[int, deque[tuple[Message, Problem]]] = {}
        self._arrival = 0
        self._order: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return any(self._queues.values())

    def add(self, msg: Message, problem: Problem) -> None:
        self._queues.setdefault(msg.partition, deque()).append((msg, problem))
        self._arrival += 1
        self._order[(msg.partition, msg.offset)] = self._arrival

    def full(self) -> list[int]:
        """Partitions whose FIFO is full (pause them)."""
        return [p for p, q in self._queues.items() if len(q) >= self.per_partition]

    def drop(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            for msg, _ in self._queues.pop(p, deque()):
                self._order.pop((msg.partition, msg.offset), None)

    def pop(
        self, assigned: Iterable[int], exhausted: Callable[[int], bool], wait: bool = True
    ) -> tuple[Message, Problem] | None:
        """The next problem in plan order, or None. With `wait`, None while an assigned partition
        that is not `exhausted` has nothing buffered (its head may come first)."""
        if wait:
            for p in assigned:
                if not self._queues.get(p) and not exhausted(p):
                    return None
        heads = [(p, q[0]) for p, q in self._queues.items() if q]
        if not heads:
            return None

        def rank(item: tuple[int, tuple[Message, Problem]]) -> tuple[int, int]:
            msg = item[1][0]
            return seq_of(msg), self._order.get((msg.partition, msg.offset), 0)

        p, _ = min(heads, key=rank)
        msg, problem = self._queues[p].popleft()
        self._order.pop((msg.partition, msg.offset), None)
        return msg, problem


class PartitionFlow:
    """Which partitions of `problems` the actor's consumer fetches: those whose FIFO in
    `ProblemOrder` is full are paused, the others resumed. A partition paused when it was revoked
    stays paused in librdkafka when it is assigned again (seen: an actor given back a partition a
    stopped actor had held waited for it for good), so every partition assigned since the last
    `apply` is resumed first."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.paused: set[TopicPartition] = set()
        self._fresh: deque[TopicPartition] = deque()

    def assigned(self, partitions: Iterable[TopicPartition]) -> None:
        """Poll thread: partitions just assigned (resumed by the next `apply`)."""
        self._fresh.extend(partitions)

    def revoked(self, partitions: Iterable[int]) -> None:
        self.paused -= {(self.topic, p) for p in partitions}

    def apply(self, consumer: Consumer, order: ProblemOrder) -> None:
        fresh = set()
        while self._fresh:
            fresh.add(self._fresh.popleft())
        if fresh:
            consumer.resume(sorted(fresh - self.paused))
        full = {(self.topic, p) for p in order.full()}
        if full != self.paused:
            consumer.resume(sorted(self.paused - full))
            consumer.pause(sorted(full - self.paused))
            self.paused = full

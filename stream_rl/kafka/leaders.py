"""Partition leaders that stopped answering, remembered between tries of an offsets listing.

librdkafka 2.16's admin ListOffsets busy-waits while a partition's leader is down: it asks the
broker thread to connect, the connection is refused at once, the state change wakes the request,
which asks again (`LISTOFFSETS worker called in state waiting for broker`, ~600,000 log lines in
15 s), keeping a core half busy until the request times out; then it reports offset -1001 for that
partition with no error. On a replicated cluster a leader's death is that case until the
controller fences it (`broker.session.timeout.ms`, 9 s by default) and elects another: every
process listing offsets (the actor's admission, the trainer, the launcher's lag monitor) spun
through it (the launcher alone: 109 CPU-s in one cluster-chaos run on 2 cores).

So a try gets `FIRST_TRY_TIMEOUT_S`, which bounds that spin; a leader that gave no offset in time
is remembered (`LeaderHealth.record`), and the next tries first check that it accepts TCP
connections (plain `connect`, nothing sent): while it refuses them and the metadata still names
it, they wait (`TransientKafkaError`, the caller's backoff) instead of handing librdkafka a request
to spin on. A leader that accepts them was only slow: its tries get `SLOW_TRY_TIMEOUT_S` for a
while. Leaders that answer in time are never probed.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from typing import Any

from stream_rl.kafka.outage import TransientKafkaError

PROBE_TIMEOUT_S = 1.0
FIRST_TRY_TIMEOUT_S = 0.5
"""A listing's request timeout, as long as its leaders answer in time (they take milliseconds)."""
SLOW_TRY_TIMEOUT_S = 5.0
"""... and for `SLOW_FOR_S` after a leader that missed it turned out to accept connections."""
SLOW_FOR_S = 60.0


def leaders_of(metadata: Any, topic: str) -> dict[int, int]:
    """partition -> leader node id, from an admin `list_topics` answer; a partition without a
    leader (-1, as after an election that has not finished) is a transient condition."""
    parts = metadata.topics[topic].partitions
    leaders = {p: int(parts[p].leader) for p in sorted(parts)}
    missing = sorted(p for p, node in leaders.items() if node < 0)
    if missing:
        raise TransientKafkaError(f"{topic} partition(s) {missing} have no leader")
    return leaders


class LeaderHealth:
    """Leaders (node id -> host, port) that gave no offset in time, and those found only slow."""

    def __init__(self) -> None:
        self._unanswered: dict[int, tuple[str, int]] = {}
        self._slow_until: dict[int, float] = {}

    def __contains__(self, node: int) -> bool:
        return node in self._unanswered

    def record(self, node: int, brokers: Mapping[int, Any]) -> None:
        """`node` led a partition whose listing came back without an offset, or timed out."""
        broker = brokers.get(node)
        if broker is not None:
            self._unanswered[node] = (str(broker.host), int(broker.port))

    def check(self, topic: str, leaders: Mapping[int, int]) -> float:
        """The request timeout for a listing of `topic` now. Raises `TransientKafkaError` while a
        remembered leader of it refuses connections; one that accepts them is forgotten, and
        given `SLOW_TRY_TIMEOUT_S` for `SLOW_FOR_S`."""
        now = time.monotonic()
        for node in sorted(set(leaders.values()) & set(self._unanswered)):
            host, port = self._unanswered[node]
            try:
                socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            except OSError as exc:
                parts = sorted(p for p, n in leaders.items() if n == node)
                raise TransientKafkaError(
                    f"node {node} ({host}:{port}), the leader of {topic} partition(s) {parts}, "
                    f"does not accept connections ({exc.strerror or exc})"
                ) from exc
            del self._unanswered[node]
            self._slow_until[node] = now + SLOW_FOR_S
        slow = any(self._slow_until.get(node, 0.0) > now for node in leaders.values())
        return SLOW_TRY_TIMEOUT_S if slow else FIRST_TRY_TIMEOUT_S

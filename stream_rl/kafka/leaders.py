"""Partition leaders that stopped answering, remembered between tries of an offsets listing.

librdkafka 2.16's admin ListOffsets busy-waits while a partition's leader is down: it asks the
broker thread to connect, the connection is refused at once, the state change wakes the request,
which asks again (`LISTOFFSETS worker called in state waiting for broker`, ~600,000 log lines in
15 s), keeping a core half busy until the request times out; then it reports offset -1001 for that
partition with no error. On a replicated cluster a leader's death is that case until the
controller fences it (`broker.session.timeout.ms`, 9 s by default) and elects another: every
process listing offsets (the actor's admission, the trainer, the launcher's lag monitor) spun
through it (the launcher alone: 109 CPU-s in one cluster-chaos run on 2 cores).

`LeaderHealth` knows the leaders to doubt: those whose connection the admin client saw drop (its
statistics, every second: state not `UP` after a disconnect) and those whose listing came back
without an offset. Before a listing it checks that each doubted leader of the topic accepts TCP
connections (plain `connect`, nothing sent) and waits it out (`TransientKafkaError`, the caller's
backoff) while it refuses them and the metadata still names it, instead of handing librdkafka a
request to spin on. Leaders whose connections stay up are never probed.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from typing import Any

from stream_rl.kafka.outage import TransientKafkaError

PROBE_TIMEOUT_S = 1.0


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
    """Leaders (node id -> host, port) to doubt before an offsets listing."""

    STATS_INTERVAL_MS = 1000
    """`statistics.interval.ms` of the admin client whose `stats_cb` is `update`."""

    def __init__(self) -> None:
        self._unanswered: dict[int, tuple[str, int]] = {}
        self._dropped: dict[int, tuple[str, int]] = {}

    def __contains__(self, node: int) -> bool:
        return node in self._unanswered or node in self._dropped

    def update(self, stats_json: str) -> None:
        """librdkafka's statistics (`stats_cb`): the brokers whose connection dropped and is not
        back up (`state` INIT, DOWN, CONNECT... after a disconnect)."""
        dropped: dict[int, tuple[str, int]] = {}
        for broker in json.loads(stats_json).get("brokers", {}).values():
            node = int(broker.get("nodeid", -1))
            host, _, port = str(broker.get("nodename", "")).rpartition(":")
            if node >= 0 and broker.get("state") != "UP" and broker.get("disconnects", 0) and port.isdigit():
                dropped[node] = (host, int(port))
        self._dropped = dropped  # one assignment: a reader on another thread sees either map

    def record(self, node: int, brokers: Mapping[int, Any]) -> None:
        """`node` led a partition whose listing came back without an offset."""
        broker = brokers.get(node)
        if broker is not None:
            self._unanswered[node] = (str(broker.host), int(broker.port))

    def check(self, topic: str, leaders: Mapping[int, int]) -> None:
        """Raise `TransientKafkaError` while a doubted leader of `topic` refuses connections;
        forget the unanswered ones that accept them again."""
        dropped = self._dropped
        for node in sorted(set(leaders.values()) & (set(self._unanswered) | set(dropped))):
            host, port = self._unanswered.get(node) or dropped[node]
            try:
                socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            except OSError as exc:
                parts = sorted(p for p, n in leaders.items() if n == node)
                raise TransientKafkaError(
                    f"node {node} ({host}:{port}), the leader of {topic} partition(s) {parts}, "
                    f"does not accept connections ({exc.strerror or exc})"
                ) from exc
            self._unanswered.pop(node, None)

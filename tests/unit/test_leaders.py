"""Leaders that gave no offset in time (stream_rl/kafka/leaders.py): asked again only once they
accept connections, then with the longer timeout for a while; a partition without a leader is a
transient condition; a topic this transport created a moment ago is waited for on a broker that
has not learned it yet."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

from stream_rl.errors import KafkaError
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.leaders import FIRST_TRY_TIMEOUT_S, SLOW_TRY_TIMEOUT_S, LeaderHealth, leaders_of
from stream_rl.kafka.outage import TransientKafkaError

pytestmark = pytest.mark.unit


def _metadata(leaders: dict[int, int]) -> SimpleNamespace:
    parts = {p: SimpleNamespace(leader=node) for p, node in leaders.items()}
    return SimpleNamespace(topics={"t": SimpleNamespace(partitions=parts)})


def test_leaders_of_names_each_partitions_leader_and_waits_out_an_election() -> None:
    assert leaders_of(_metadata({1: 3, 0: 2}), "t") == {0: 2, 1: 3}
    with pytest.raises(TransientKafkaError, match=r"t partition\(s\) \[1\] have no leader"):
        leaders_of(_metadata({0: 2, 1: -1}), "t")


def test_a_leader_that_gave_no_offset_is_probed_until_it_accepts_connections() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    brokers = {2: SimpleNamespace(host="127.0.0.1", port=port), 3: SimpleNamespace(host="127.0.0.1", port=1)}
    health = LeaderHealth()
    # Nothing remembered: nothing probed (port 1 refuses), the short timeout.
    assert health.check("t", {0: 2, 1: 3}) == FIRST_TRY_TIMEOUT_S
    health.record(2, brokers)
    health.record(7, brokers)  # not in the metadata's brokers: nothing to probe
    assert 2 in health and 7 not in health
    listener.close()  # node 2 is down
    with pytest.raises(
        TransientKafkaError, match=r"node 2 \(127.0.0.1:\d+\), the leader of t partition\(s\) \[0\]"
    ):
        health.check("t", {0: 2, 1: 3})
    assert health.check("t", {0: 3, 1: 3}) == FIRST_TRY_TIMEOUT_S  # another node leads: 2 not asked
    assert 2 in health
    listener = socket.create_server(("127.0.0.1", port))  # node 2 is back: it was only slow
    try:
        assert health.check("t", {0: 2, 1: 3}) == SLOW_TRY_TIMEOUT_S
    finally:
        listener.close()
    assert 2 not in health, "forgotten once it answers"
    assert health.check("t", {0: 2}) == SLOW_TRY_TIMEOUT_S, "the longer timeout for a while"
    assert health.check("t", {0: 3}) == FIRST_TRY_TIMEOUT_S


class _LaggingAdmin:
    """An admin client whose answering broker learns topic `t` only on its `known_after`th question."""

    def __init__(self, known_after: int) -> None:
        self.asked = 0
        self.known_after = known_after

    def list_topics(self, topic: str, timeout: float) -> SimpleNamespace:
        self.asked += 1
        if self.asked < self.known_after:
            return SimpleNamespace(topics={})
        replicas = SimpleNamespace(leader=1, replicas=[1, 2, 3])
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={0: replicas})})

    def poll(self, timeout: float) -> int:
        return 0


def test_a_topic_this_transport_just_created_is_waited_for_not_called_missing() -> None:
    kafka = KafkaTransport("b:9092", outage_s=5.0)
    lagging = _LaggingAdmin(known_after=3)
    kafka._admin = lagging  # type: ignore[assignment]
    with pytest.raises(KafkaError, match=r"topic t does not exist \(run `stream-rl topics apply"):
        kafka.replication_factor("t")  # nobody here created it: missing at the first answer
    assert lagging.asked == 1
    kafka._created["t"] = time.monotonic()  # what create_topics records
    assert kafka.replication_factor("t") == 3  # asked again until the broker caught up
    assert lagging.asked == 3

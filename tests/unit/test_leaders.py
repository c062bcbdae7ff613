"""Leaders that gave no offset (stream_rl/kafka/leaders.py): asked again only once they accept
connections; a partition without a leader is a transient condition."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from stream_rl.kafka.leaders import UnansweredLeaders, leaders_of
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
    unanswered = UnansweredLeaders()
    unanswered.check("t", {0: 2, 1: 3})  # nothing remembered: nothing probed, nothing raised
    unanswered.record(2, brokers)
    unanswered.record(7, brokers)  # not in the metadata's brokers: nothing to probe
    assert 2 in unanswered and 7 not in unanswered
    listener.close()  # node 2 is down
    with pytest.raises(
        TransientKafkaError, match=r"node 2 \(127.0.0.1:\d+\), the leader of t partition\(s\) \[0\]"
    ):
        unanswered.check("t", {0: 2, 1: 3})
    unanswered.check("t", {0: 3, 1: 3})  # another node leads now: node 2 is not asked
    assert 2 in unanswered
    listener = socket.create_server(("127.0.0.1", port))  # node 2 is back
    try:
        unanswered.check("t", {0: 2, 1: 3})
    finally:
        listener.close()
    assert 2 not in unanswered, "forgotten once it answers"

"""Leaders to doubt before an offsets listing (stream_rl/kafka/leaders.py): those whose connection
dropped (the admin client's statistics) or that gave no offset are asked only once they accept
connections; a partition without a leader is a transient condition."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest

from stream_rl.kafka.leaders import LeaderHealth, leaders_of
from stream_rl.kafka.outage import TransientKafkaError

pytestmark = pytest.mark.unit


def _metadata(leaders: dict[int, int]) -> SimpleNamespace:
    parts = {p: SimpleNamespace(leader=node) for p, node in leaders.items()}
    return SimpleNamespace(topics={"t": SimpleNamespace(partitions=parts)})


def _stats(**brokers: tuple[int, str, int]) -> str:
    """librdkafka's statistics JSON, its `brokers` part: name -> (nodeid, state, disconnects)."""
    return json.dumps(
        {
            "brokers": {
                f"{name}/{node}": {"nodeid": node, "nodename": name, "state": state, "disconnects": drops}
                for name, (node, state, drops) in brokers.items()
            }
        }
    )


def test_leaders_of_names_each_partitions_leader_and_waits_out_an_election() -> None:
    assert leaders_of(_metadata({1: 3, 0: 2}), "t") == {0: 2, 1: 3}
    with pytest.raises(TransientKafkaError, match=r"t partition\(s\) \[1\] have no leader"):
        leaders_of(_metadata({0: 2, 1: -1}), "t")


def test_a_leader_that_gave_no_offset_is_probed_until_it_accepts_connections() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    brokers = {2: SimpleNamespace(host="127.0.0.1", port=port), 3: SimpleNamespace(host="127.0.0.1", port=1)}
    health = LeaderHealth()
    health.check("t", {0: 2, 1: 3})  # nothing doubted: nothing probed (port 1 refuses), nothing raised
    health.record(2, brokers)
    health.record(7, brokers)  # not in the metadata's brokers: nothing to probe
    assert 2 in health and 7 not in health
    listener.close()  # node 2 is down
    with pytest.raises(
        TransientKafkaError, match=r"node 2 \(127.0.0.1:\d+\), the leader of t partition\(s\) \[0\]"
    ):
        health.check("t", {0: 2, 1: 3})
    health.check("t", {0: 3, 1: 3})  # another node leads now: node 2 is not asked
    assert 2 in health
    listener = socket.create_server(("127.0.0.1", port))  # node 2 is back
    try:
        health.check("t", {0: 2, 1: 3})
    finally:
        listener.close()
    assert 2 not in health, "forgotten once it answers"


def test_a_leader_whose_connection_dropped_is_probed_while_it_is_not_back_up() -> None:
    health = LeaderHealth()
    never = "127.0.0.1:1"  # nothing listens on port 1
    health.update(_stats(**{never: (3, "INIT", 0)}))  # never connected: nothing known against it
    health.check("t", {0: 3})
    health.update(_stats(**{never: (3, "UP", 1)}))  # dropped once, connected again
    health.check("t", {0: 3})
    health.update(_stats(**{never: (3, "INIT", 1)}))  # dropped, not back
    assert 3 in health
    with pytest.raises(
        TransientKafkaError, match=r"node 3 \(127.0.0.1:1\), the leader of t partition\(s\) \[0\]"
    ):
        health.check("t", {0: 3})
    health.update(_stats(**{never: (3, "UP", 1)}))
    assert 3 not in health

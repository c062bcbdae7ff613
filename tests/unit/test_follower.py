"""VersionFollower: keeps the latest weight version of a run."""

from __future__ import annotations

import pytest

from stream_rl.kafka.follower import VersionFollower
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import WEIGHT_VERSIONS, TopicNames
from stream_rl.testing import make_weight_version

pytestmark = pytest.mark.unit


def test_follows_versions_and_waits() -> None:
    t = MemoryTransport()
    names = TopicNames(run="r")
    t.create_topics(names.all_topics())
    follower = VersionFollower(t, names, keep_history=True).start()
    try:
        assert follower.latest is None
        assert not follower.wait_for_version(0, timeout=0.05)
        p = t.producer("trainer")
        for v in range(3):
            p.produce(names[WEIGHT_VERSIONS], default_serde().encode(make_weight_version(v)), key="r")
        p.produce(names[WEIGHT_VERSIONS], b"garbage", key="r")
        assert follower.wait_for_version(2, timeout=5)
        latest = follower.latest
        assert latest is not None and latest.version == 2
        assert [w.version for w in follower.drain()] == [0, 1, 2]
        assert follower.drain() == []  # handed over once: the follower keeps nothing
    finally:
        follower.stop()

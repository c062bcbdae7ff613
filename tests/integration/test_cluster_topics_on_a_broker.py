"""Replication settings against the real (single) broker: what `topics apply` creates, the drift it
reads back from the broker's metadata and configs, and a replication factor the cluster cannot hold."""

from __future__ import annotations

import uuid

import pytest

from stream_rl.errors import ConfigError
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.topics import TopicNames, apply_topics

pytestmark = pytest.mark.integration


def test_replication_is_created_read_back_and_drift_reported(kafka: KafkaTransport) -> None:
    names = TopicNames(run=f"rf{uuid.uuid4().hex[:8]}")
    assert kafka.broker_count() == 1
    with pytest.raises(ConfigError, match="replication factor 3 but the cluster has 1 broker"):
        apply_topics(kafka, names, replication_factor=3, min_insync_replicas=2)
    # Made by hand with min ISR 2 (Kafka accepts it on one replica; every acks=all write would fail).
    kafka.create_topics(names.all_topics(min_insync_replicas=2), names.replication_factors())
    scored = names["scored"]
    assert kafka.replication_factor(scored) == 1
    assert kafka.topic_configs([scored])[scored]["min.insync.replicas"] == "2"
    report = apply_topics(kafka, names)
    assert report.created == []
    assert f"{scored}: min.insync.replicas=2, topology says 1" in report.drift
    assert not [d for d in report.drift if "replication factor" in d]

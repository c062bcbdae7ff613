"""Cluster-grade topics: replication factor and min.insync.replicas per topic in the topology,
overridden by `kafka.replication_factor` / `kafka.min_insync_replicas`, checked against the
cluster's broker count, reported as drift by `topics apply`; producers stay idempotent, acks=all.
On the in-memory transport (which pretends to have N brokers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stream_rl.config import load_config
from stream_rl.errors import ConfigError
from stream_rl.kafka.memory import MemoryBroker, MemoryTransport
from stream_rl.kafka.topics import TopicNames, apply_topics, load_topology

pytestmark = pytest.mark.unit


def _cluster(brokers: int) -> MemoryTransport:
    return MemoryTransport(MemoryBroker(brokers=brokers))


def test_the_topology_replicates_once_locally() -> None:
    for spec in load_topology().values():
        assert (spec.replication_factor, spec.min_insync_replicas) == (1, 1), spec.name


def test_overrides_reach_every_topic_dlqs_included() -> None:
    names = TopicNames(run="r")
    topics = names.all_topics(min_insync_replicas=2)
    factors = names.replication_factors(3)
    assert {t[0] for t in topics} == set(factors)
    assert any(t[0].endswith(".dlq") for t in topics)
    assert all(conf["min.insync.replicas"] == "2" for _, _, conf in topics)
    assert set(factors.values()) == {3}
    assert all(conf["min.insync.replicas"] == "1" for _, _, conf in names.all_topics())


def test_apply_creates_replicated_topics_and_reapplies_clean() -> None:
    kafka = _cluster(3)
    names = TopicNames(run="r")
    first = apply_topics(kafka, names, replication_factor=3, min_insync_replicas=2)
    assert len(first.created) == len(names.all_topics()) and not first.drift
    assert kafka.replication_factor(names["scored"]) == 3
    assert kafka.topic_configs([names.dlq("scored")])[names.dlq("scored")]["min.insync.replicas"] == "2"
    again = apply_topics(kafka, names, replication_factor=3, min_insync_replicas=2)
    assert again.created == [] and again.drift == []


def test_apply_reports_replication_drift() -> None:
    kafka = _cluster(3)
    names = TopicNames(run="r")
    apply_topics(kafka, names)  # 1/1, the topology's
    report = apply_topics(kafka, names, replication_factor=3, min_insync_replicas=2)
    scored = names["scored"]
    assert (
        f"{scored}: replication factor 1, topology says 3 (Kafka changes it only by partition reassignment)"
        in (report.drift)
    )
    assert f"{scored}: min.insync.replicas=1, topology says 2" in report.drift
    assert len(report.drift) == 2 * len(names.all_topics())


def test_more_replicas_than_brokers_is_one_line_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"replication factor 3 but the cluster has 1 broker.*kafka\.replication_factor"
    ):
        apply_topics(_cluster(1), TopicNames(run="r"), replication_factor=3)


def test_min_isr_above_the_replication_factor_is_refused_before_anything_is_created() -> None:
    kafka = _cluster(3)
    with pytest.raises(ConfigError, match=r"min.insync.replicas 2 > replication factor 1"):
        apply_topics(kafka, TopicNames(run="r"), min_insync_replicas=2)
    assert kafka.list_topic_names() == []


def test_run_config_refuses_min_isr_above_replication_factor() -> None:
    with pytest.raises(
        ConfigError, match=r"kafka\.min_insync_replicas \(3\) must not exceed kafka\.replication_factor \(2\)"
    ):
        load_config(None, ["kafka.replication_factor=2", "kafka.min_insync_replicas=3"])
    cfg = load_config(None, ["kafka.replication_factor=3", "kafka.min_insync_replicas=2"])
    assert (cfg.kafka.replication_factor, cfg.kafka.min_insync_replicas) == (3, 2)


def test_a_topology_with_min_isr_above_its_replication_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "topics.yaml"
    bad.write_text(
        "topics:\n  t:\n    key: k\n    value: V\n    producer: p\n    partitions: 1\n    retention_ms: -1\n"
        "    cleanup_policy: delete\n    replication_factor: 1\n    min_insync_replicas: 2\n"
    )
    with pytest.raises(
        ConfigError, match="topic t: min_insync_replicas must be between 1 and replication_factor"
    ):
        load_topology(bad)


class _RecordingProducer:
    confs: list[dict[str, Any]] = []

    def __init__(self, conf: dict[str, Any]) -> None:
        type(self).confs.append(conf)


def test_producers_are_idempotent_with_acks_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where: `stream_rl/kafka/producer.py` KafkaProducer, the only producer class every stage uses
    (plain and transactional); client properties cannot override these (config refuses them)."""
    from stream_rl.kafka import confluent

    _RecordingProducer.confs = []
    monkeypatch.setattr(confluent.ck, "Producer", _RecordingProducer)
    kafka = confluent.KafkaTransport("b:9092", properties={"linger.ms": "50"})
    kafka.producer("plain")
    kafka.producer("tx", transactional_id="tx-1")
    for conf in _RecordingProducer.confs:
        assert conf["enable.idempotence"] is True and conf["acks"] == "all"
    assert _RecordingProducer.confs[1]["transactional.id"] == "tx-1"
    for key in ("acks", "enable.idempotence"):
        with pytest.raises(ConfigError, match=f"kafka.client_properties: {key} is not settable"):
            load_config(None, [f"kafka.client_properties={{{key}: '1'}}"])


def test_a_local_cluster_node_names_its_voters_and_replicates_internal_topics(tmp_path: Path) -> None:
    import json

    from stream_rl.errors import BrokerError
    from stream_rl.kafka.cluster import LocalCluster

    cluster = LocalCluster(tmp_path, brokers=3, ports=[9301, 9302, 9303])
    node = cluster.node(1)
    node.data_dir.mkdir()
    text = node._write_config(cluster.layout.controller_ports[1]).read_text()
    props = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    voters = ",".join(f"{i + 1}@127.0.0.1:{p}" for i, p in enumerate(cluster.layout.controller_ports))
    assert props["node.id"] == "2" and props["controller.quorum.voters"] == voters
    assert "controller.quorum.bootstrap.servers" not in props  # static voters, not a standalone quorum
    assert (
        props["offsets.topic.replication.factor"] == props["transaction.state.log.replication.factor"] == "3"
    )
    assert props["transaction.state.log.min.isr"] == "2"
    assert props["listeners"].startswith("PLAINTEXT://127.0.0.1:9302,")
    assert not set(cluster.layout.controller_ports) & {9301, 9302, 9303}
    assert cluster.bootstrap == "127.0.0.1:9301,127.0.0.1:9302,127.0.0.1:9303"
    (tmp_path / "cluster.json").write_text(json.dumps(cluster.layout.__dict__))
    with pytest.raises(BrokerError, match="holds a 3-broker cluster; use --brokers 3"):
        LocalCluster(tmp_path, brokers=2)
    assert LocalCluster(tmp_path, brokers=3, port=1).layout == cluster.layout  # the recorded one wins


def test_the_launcher_uses_a_local_cluster_it_finds_and_leaves_it_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from stream_rl.kafka import cluster as cluster_module
    from stream_rl.kafka.stage import StopFlag
    from stream_rl.run.launch import Launcher

    layout = {"ports": [9401, 9402, 9403], "controller_ports": [9411, 9412, 9413], "cluster_id": "x"}
    (tmp_path / "cluster.json").write_text(json.dumps(layout))
    started: list[int] = []

    def up(self: cluster_module.LocalCluster, quiet: bool = False) -> str:  # no JVMs in a unit test
        started.append(len(self.layout.ports))
        return self.bootstrap

    monkeypatch.setattr(cluster_module.LocalCluster, "up", up)
    monkeypatch.delenv("STREAM_RL_KAFKA_BOOTSTRAP", raising=False)
    cfg = load_config(None, [f"kafka.data_dir={tmp_path}", f"runs_dir={tmp_path / 'runs'}"])
    launcher = Launcher(cfg, StopFlag())
    assert launcher.start_broker() == "127.0.0.1:9401,127.0.0.1:9402,127.0.0.1:9403"
    assert started == [3] and launcher.broker is None  # the user's cluster: not stopped at the end

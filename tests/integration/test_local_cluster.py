"""A local 3-node KRaft cluster (`stream-rl kafka up --brokers 3`): the run's topics replicated
3 times with min ISR 2, and the broker leading `training-batches` SIGKILLed between two batches of
acks=all writes: every record is read back once, in order; the killed node restarts and rejoins."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stream_rl.common.ports import free_port
from stream_rl.kafka.cluster import LocalCluster, cluster_layout
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.topics import TRAINING_BATCHES, TopicNames, apply_topics

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), brokers=3, ports=[free_port() for _ in range(3)])
    c.up(quiet=True)
    try:
        yield c
    finally:
        c.down(quiet=True)


def _leader(kafka: KafkaTransport, topic: str) -> int:
    return int(kafka.admin.list_topics(topic=topic, timeout=10).topics[topic].partitions[0].leader)


def test_a_killed_leader_loses_no_acknowledged_record(cluster: LocalCluster, tmp_path: Path) -> None:
    assert cluster_layout(cluster.data_dir) == cluster.layout  # `down`/`status` find it again
    kafka = KafkaTransport(cluster.bootstrap)
    assert kafka.broker_count() == 3
    names = TopicNames(run=f"c{uuid.uuid4().hex[:8]}")
    report = apply_topics(kafka, names, replication_factor=3, min_insync_replicas=2)
    assert report.drift == [] and report.created
    topic = names[TRAINING_BATCHES]
    assert kafka.replication_factor(topic) == 3
    assert kafka.topic_configs([topic])[topic]["min.insync.replicas"] == "2"
    producer = kafka.producer("writer")
    for i in range(20):
        producer.produce(topic, str(i).encode(), key="k")
    producer.flush()
    leader = _leader(kafka, topic)
    assert kafka.watermarks(topic) == {0: (0, 20)}  # the admin client is connected to the leader
    killed = cluster.node(leader - 1)
    st = killed.running()
    assert st is not None
    os.kill(st.pid, signal.SIGKILL)
    # Listing offsets while the metadata still names the dead leader, whose dropped connection the
    # admin client has seen: the true offsets, once another node leads, and no busy wait meanwhile
    # (librdkafka's ListOffsets alone spins half a core until its timeout, then answers -1001:
    # stream_rl/kafka/leaders.py).
    time.sleep(2)
    cpu = time.process_time()
    assert kafka.watermarks(topic) == {0: (0, 20)}
    cpu = time.process_time() - cpu
    assert cpu < 1.5, f"{cpu:.1f} CPU-s spent listing offsets while the leader was down"
    for i in range(20, 40):  # acks=all: two in-sync replicas are left, enough for min ISR 2
        producer.produce(topic, str(i).encode(), key="k")
    producer.flush(timeout=60)
    assert _leader(kafka, topic) not in (leader, -1)
    consumer = kafka.consumer(f"check-{names.run}", "reader")
    consumer.subscribe([topic])
    got: list[int] = []
    for _ in range(120):
        got += [int(m.value or b"-1") for m in consumer.poll_batch(100, 0.5)]
        if len(got) >= 40:
            break
    consumer.close()
    assert got == list(range(40)), "lost, duplicated or reordered records"
    killed.up(quiet=True)  # it rejoins the running quorum
    assert kafka.broker_count() == 3


def test_the_cli_finds_the_cluster_by_its_data_dir(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    from stream_rl.cli import main as cli_main
    from stream_rl.kafka.broker import resolve_bootstrap

    data_dir = str(cluster.data_dir)
    assert resolve_bootstrap(None, None, data_dir) == cluster.bootstrap
    assert cli_main(["kafka", "up", "--data-dir", data_dir, "--quiet"]) == 0  # running: a no-op
    assert capsys.readouterr().out.strip() == cluster.bootstrap
    assert cli_main(["kafka", "status", "--data-dir", data_dir]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["node-0", "node-1", "node-2"]
    assert all(", answering;" in line for line in lines)
    assert cli_main(["kafka", "status", "--data-dir", data_dir, "--brokers", "2"]) == 2
    assert "holds a 3-broker cluster; use --brokers 3" in capsys.readouterr().err

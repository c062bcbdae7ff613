"""`stream-rl kafka up --secure --brokers 3`: three KRaft nodes whose controller quorum and
replication go over mutual TLS (CN=broker, a super user), clients over SCRAM or their certificates,
ACLs on. The run's topics are made by the launcher's principal with 3 copies and min ISR 2; an
actor's acks=all write is acknowledged (two replicas in sync: replication works between the nodes)
over either listener, and its write to `training-batches` is refused. The single secured broker's
break-in tests: tests/integration/test_secure_cluster.py."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from stream_rl.cli import main as cli_main
from stream_rl.common.ports import free_port, port_is_free
from stream_rl.config import load_config
from stream_rl.errors import KafkaError
from stream_rl.kafka.cluster import LocalCluster
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.topics import RAW_ROLLOUTS, TRAINING_BATCHES, TopicNames, apply_topics

pytestmark = pytest.mark.integration

RUN = f"sc{uuid.uuid4().hex[:6]}"


def _six_free_ports() -> int:
    for _ in range(100):
        port = free_port()
        if all(port_is_free(port + i) for i in range(1, 6)):
            return port
    raise AssertionError("no six adjacent free ports")


def test_a_secured_three_node_cluster_replicates_and_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "kafka"
    up = ["kafka", "up", "--secure", "--brokers", "3", "--data-dir", str(data_dir)]
    try:
        assert cli_main([*up, "--port", str(_six_free_ports()), "--run", RUN, "--quiet"]) == 0
        capsys.readouterr()
        props = (data_dir / "node-1" / "server.properties").read_text()
        assert (
            "PLAINTEXT" not in props and "listener.security.protocol.map=CONTROLLER:SSL,INTERNAL:SSL" in props
        )
        run_dir = data_dir / "secure" / "runs" / RUN
        names = TopicNames(RUN)
        for section in ("kafka.yaml", "kafka-mtls.yaml"):
            kafka = load_config(run_dir / section, [f"run={RUN}"]).kafka
            assert len((kafka.bootstrap or "").split(",")) == 3
            assert (kafka.replication_factor, kafka.min_insync_replicas) == (3, 2)
            launcher = kafka.acting_as("launcher")
            apply_topics(
                KafkaTransport.for_config(launcher, kafka.bootstrap or "", outage_s=20),
                names,
                None,
                replication_factor=kafka.replication_factor,
                min_insync_replicas=kafka.min_insync_replicas,
            )
            actor = kafka.for_role("actor")
            producer = KafkaTransport.for_config(actor, actor.bootstrap or "", outage_s=20).producer("a")
            producer.produce(names[RAW_ROLLOUTS], b"x", key="k")
            producer.flush(timeout=30)  # acks=all with min ISR 2: the nodes replicate
            # Refused at produce when the client already knows (the topic's metadata), else at flush.
            with pytest.raises(KafkaError, match=rf"Kafka refused User:{RUN}-actor WRITE on topic"):
                producer.produce(names[TRAINING_BATCHES], b"x", key="k")
                producer.flush(timeout=30)
        assert cli_main(["kafka", "status", "--data-dir", str(data_dir)]) == 0
        assert capsys.readouterr().out.count(", answering;") == 3  # probed as the operator
    finally:
        LocalCluster(data_dir, brokers=3).down(quiet=True)

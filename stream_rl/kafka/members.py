"""Removing a stopped static member from its consumer group, so that its partitions are
reassigned at once rather than when its session expires (`max(30 s, kafka.outage_timeout_s)`).

The stages are static members (`group.instance.id` = `<prefix>.<run>.<stage>.<instance>`) so that
a *restarted* replica takes its partitions back without a rebalance; the price is that librdkafka's
static members do not leave the group when they close. Kafka's Admin API removes them
(`removeMembersFromConsumerGroup`, KIP-345), librdkafka has no such call, so this runs the
broker's own client jars on `deploy/kafka/RemoveStaticMembers.java` (`stream_rl/kafka/java_admin.py`:
compiled once, PLAINTEXT brokers only; on a secured cluster nothing is tried and the session
expires as before). `stream-rl scale` uses it when it stops a replica of a launcher-managed run.
"""

from __future__ import annotations

from stream_rl.config import KafkaConfig
from stream_rl.kafka.broker import DEPLOY_DIR
from stream_rl.kafka.java_admin import run_program

PROGRAM = DEPLOY_DIR / "RemoveStaticMembers.java"


def remove_static_members(
    kafka: KafkaConfig, bootstrap: str, group: str, instance_ids: list[str], timeout_s: float = 60.0
) -> tuple[bool, str]:
    """(every member removed, what happened in one line). Never raises."""
    res = run_program(kafka, bootstrap, PROGRAM, [group, *instance_ids], timeout_s)
    if not res.ran:
        return False, res.why
    lines = [line for line in res.lines if line.startswith(("removed ", "kept "))]
    if not lines:
        return False, res.why or f"exit {res.returncode}"
    return res.returncode == 0, "; ".join(lines)

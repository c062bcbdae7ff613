"""Removing a stopped static member from its consumer group, so that its partitions are
reassigned at once rather than when its session expires (`max(30 s, kafka.outage_timeout_s)`).

The stages are static members (`group.instance.id` = `<prefix>.<run>.<stage>.<instance>`) so that
a *restarted* replica takes its partitions back without a rebalance; the price is that librdkafka's
static members do not leave the group when they close. Kafka's Admin API removes them
(`removeMembersFromConsumerGroup`, KIP-345), librdkafka has no such call, so this runs the
broker's own client jars on `deploy/kafka/RemoveStaticMembers.java` (a single-file Java program;
about two seconds). `stream-rl scale` uses it when it stops a replica of a launcher-managed run.
Only for a PLAINTEXT broker with the jars fetched (a local one): a secured cluster's Java client
settings differ from librdkafka's, so there nothing is tried and the session expires as before.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from stream_rl.config import KafkaConfig
from stream_rl.kafka.broker import DEPLOY_DIR, jars_dir

PROGRAM = DEPLOY_DIR / "RemoveStaticMembers.java"


def remove_static_members(
    kafka: KafkaConfig, bootstrap: str, group: str, instance_ids: list[str], timeout_s: float = 60.0
) -> tuple[bool, str]:
    """(every member removed, what happened in one line). Never raises."""
    if kafka.client_properties or kafka.secret_properties:
        return False, "not tried on a secured cluster"
    java = shutil.which("java")
    jars = jars_dir()
    if java is None or not any(jars.glob("kafka-clients-*.jar")):
        return False, "not tried: no java or no Kafka jars here (`stream-rl kafka fetch`)"
    with tempfile.TemporaryDirectory(prefix="stream-rl-members-") as tmp:
        props = Path(tmp) / "client.properties"
        props.write_text(
            f"bootstrap.servers={bootstrap}\nrequest.timeout.ms=15000\ndefault.api.timeout.ms=30000\n"
        )
        cmd = [java, "-cp", f"{jars}/*", str(PROGRAM), str(props), group, *instance_ids]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False, f"no answer within {timeout_s:.0f} s"
    lines = [line for line in res.stdout.splitlines() if line.startswith(("removed ", "kept "))]
    if not lines:
        return False, (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
    return res.returncode == 0, "; ".join(lines)

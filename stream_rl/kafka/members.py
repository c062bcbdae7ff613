"""Removing a stopped static member from its consumer group, so that its partitions are
reassigned at once rather than when its session expires (`max(30 s, kafka.outage_timeout_s)`).

The stages are static members (`group.instance.id` = `<prefix>.<run>.<stage>.<instance>`) so that
a *restarted* replica takes its partitions back without a rebalance; the price is that librdkafka's
static members do not leave the group when they close. Kafka's Admin API removes them
(`removeMembersFromConsumerGroup`, KIP-345), librdkafka has no such call, so this runs the
broker's own client jars on `deploy/kafka/RemoveStaticMembers.java`, compiled once with `javac`
into the jars' cache (a JRE without `javac` runs it as a single-file source program: 2.2 s instead
of 1.3 s, and 3.9 instead of 2.0 CPU-s, `bench/static_members.py`). `stream-rl scale` uses it when
it stops a replica of a launcher-managed run.
Only for a PLAINTEXT broker with the jars fetched (a local one): a secured cluster's Java client
settings differ from librdkafka's, so there nothing is tried and the session expires as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from stream_rl.config import KafkaConfig
from stream_rl.kafka.broker import DEPLOY_DIR, jars_dir

PROGRAM = DEPLOY_DIR / "RemoveStaticMembers.java"


def program_command(java: str, jars: Path, timeout_s: float = 60.0) -> list[str]:
    """`java` and its arguments up to the program's own: the class compiled into
    `<jars>/../members/<source digest>/` (compiled now if it is not there yet), or the source
    file itself when there is no `javac` or it fails (its error then shows when the program runs)."""
    javac = shutil.which("javac")
    source = PROGRAM.read_bytes()
    out = jars.parent / "members" / hashlib.sha256(source + str(javac).encode()).hexdigest()[:12]
    classpath = f"{jars}/*"
    if javac is not None and not (out / "RemoveStaticMembers.class").exists():
        tmp = out.with_name(f"{out.name}.{uuid.uuid4().hex[:8]}.tmp")
        res = subprocess.run(
            [javac, "-nowarn", "-cp", classpath, "-d", str(tmp), str(PROGRAM)],
            capture_output=True,
            timeout=timeout_s,
        )
        if res.returncode == 0:
            with contextlib.suppress(OSError):  # another process compiled it meanwhile: theirs is the same
                tmp.rename(out)
        shutil.rmtree(tmp, ignore_errors=True)
    if (out / "RemoveStaticMembers.class").exists():
        return [java, "-cp", f"{out}:{classpath}", "RemoveStaticMembers"]
    return [java, "-cp", classpath, str(PROGRAM)]


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
        try:
            cmd = [*program_command(java, jars, timeout_s), str(props), group, *instance_ids]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False, f"no answer within {timeout_s:.0f} s"
    lines = [line for line in res.stdout.splitlines() if line.startswith(("removed ", "kept "))]
    if not lines:
        return False, (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
    return res.returncode == 0, "; ".join(lines)

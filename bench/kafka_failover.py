"""Failover of a local 3-node cluster (`stream-rl kafka up --brokers 3`) under acks=all writes.

Per repeat: SIGKILL the broker leading a replication-3 / min-ISR-2 topic while an idempotent
producer writes one record every 10 ms; measures the longest gap between two acknowledged
records around the kill (how long writes stall until a new leader takes over), the time until
the killed node answers again after its restart, and counts records lost or duplicated (read
back from the topic, independently of the producer). Also: the cluster's start-up time.

    python bench/kafka_failover.py [--repeats 3]

Writes bench/results/kafka_failover.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import confluent_kafka as ck

from stream_rl.common.ports import free_port
from stream_rl.kafka.cluster import LocalCluster
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.topics import TRAINING_BATCHES, TopicNames, apply_topics

RESULTS = Path(__file__).parent / "results" / "kafka_failover.json"


def one_failover(cluster: LocalCluster, kafka: KafkaTransport, topic: str, records: int) -> dict[str, Any]:
    acked: list[tuple[float, int]] = []

    def on_delivery(err: ck.KafkaError | None, msg: ck.Message) -> None:
        if err is None:
            acked.append((time.monotonic(), int(msg.value())))

    producer = ck.Producer(
        {"bootstrap.servers": cluster.bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 0}
    )
    base = sum(h - lo for lo, h in kafka.watermarks(topic).values())
    leader = int(kafka.admin.list_topics(topic=topic, timeout=10).topics[topic].partitions[0].leader)
    node = cluster.node(leader - 1)
    st = node.running()
    assert st is not None
    killed_at = 0.0
    for i in range(records):
        if i == records // 4:
            killed_at = time.monotonic()
            os.kill(st.pid, signal.SIGKILL)
        producer.produce(topic, str(base + i).encode(), key="k", on_delivery=on_delivery)
        producer.poll(0.01)
    assert producer.flush(120) == 0, "records not acknowledged within 120 s"
    times = [t for t, _ in acked if t >= killed_at]
    stall = max(b - a for a, b in zip([killed_at, *times], times, strict=False))
    t0 = time.monotonic()
    node.up(quiet=True)
    rejoin = time.monotonic() - t0
    consumer = kafka.consumer(f"failover-check-{uuid.uuid4().hex[:6]}", "bench")
    consumer.subscribe([topic])
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while len(seen) < base + records and time.monotonic() < deadline:
        seen += [int(m.value or b"-1") for m in consumer.poll_batch(500, 0.5)]
    consumer.close()
    mine = [v for v in seen if v >= base]
    return {
        "write_stall_s": stall,
        "restart_to_answer_s": rejoin,
        "lost": len(set(range(base, base + records)) - set(mine)),
        "duplicated": len(mine) - len(set(mine)),
        "in_order": mine == sorted(mine),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--records", type=int, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp) / "k", brokers=3, ports=[free_port() for _ in range(3)])
        t0 = time.monotonic()
        cluster.up(quiet=True)
        startup = time.monotonic() - t0
        try:
            kafka = KafkaTransport(cluster.bootstrap)
            names = TopicNames(run=f"failover{uuid.uuid4().hex[:6]}")
            apply_topics(kafka, names, replication_factor=3, min_insync_replicas=2)
            runs = [
                one_failover(cluster, kafka, names[TRAINING_BATCHES], args.records)
                for _ in range(args.repeats)
            ]
        finally:
            cluster.down(quiet=True)
    stalls = [r["write_stall_s"] for r in runs]
    rejoins = [r["restart_to_answer_s"] for r in runs]
    print(f"3-node cluster start-up: {startup:.1f} s")
    print(f"{'repeat':>6}  {'write stall s':>13}  {'restart s':>9}  {'lost':>4}  {'dup':>3}  in order")
    for i, r in enumerate(runs):
        print(
            f"{i:>6}  {r['write_stall_s']:>13.2f}  {r['restart_to_answer_s']:>9.1f}  {r['lost']:>4}  "
            f"{r['duplicated']:>3}  {r['in_order']}"
        )
    print(
        f"median write stall {statistics.median(stalls):.2f} s, median restart {statistics.median(rejoins):.1f} s"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps({"startup_s": startup, "records_per_repeat": args.records, "repeats": runs}, indent=1)
        + "\n"
    )


if __name__ == "__main__":
    main()

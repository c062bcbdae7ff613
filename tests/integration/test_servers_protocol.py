"""A deployment's own writer of server membership, built from docs/servers-protocol.md alone
(confluent-kafka, fastavro and `schemas/ServerMembership.avsc`; none of stream_rl's Kafka code):
its records are what the run reads, and the records `stream-rl servers` writes are what the page
says. Against a real broker."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import confluent_kafka as ck
import pytest
import yaml
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint, to_parsing_canonical_form

from stream_rl.kafka.servers_topic import announce, read_members
from stream_rl.kafka.topics import TopicNames

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RAW = json.loads((REPO / "schemas" / "ServerMembership.avsc").read_text())
SCHEMA = parse_schema(RAW)
FP = bytes.fromhex(fingerprint(to_parsing_canonical_form(RAW), "CRC-64-AVRO"))


def single_object(record: dict) -> bytes:  # type: ignore[type-arg]
    """docs/concepts.md "Contracts on the wire": C3 01, the 8-byte fingerprint, the Avro body."""
    body = io.BytesIO()
    schemaless_writer(body, SCHEMA, record)
    return b"\xc3\x01" + FP + body.getvalue()


def write(bootstrap: str, run: str, url: str, state: str) -> None:
    producer = ck.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "log_level": 0})
    record = {
        "run_id": run,
        "url": url,
        "engine": "builtin",
        "state": state,
        "announced_by": "outside",
        "created_ms": int(time.time() * 1000),
    }
    producer.produce(f"stream-rl.{run}.servers", key=url.encode(), value=single_object(record))
    assert producer.flush(10) == 0


def read_all(bootstrap: str, run: str) -> list[tuple[bytes, dict]]:  # type: ignore[type-arg]
    consumer = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": "outside", "log_level": 0})
    name = f"stream-rl.{run}.servers"
    try:
        _low, high = consumer.get_watermark_offsets(ck.TopicPartition(name, 0), timeout=10)
        consumer.assign([ck.TopicPartition(name, 0, 0)])
        out = []
        deadline = time.monotonic() + 20
        while len(out) < high and time.monotonic() < deadline:
            for m in consumer.consume(10, 0.5):
                if m.error() is None:
                    value = m.value()
                    assert value[:2] == b"\xc3\x01" and value[2:10] == FP
                    out.append((m.key(), schemaless_reader(io.BytesIO(value[10:]), SCHEMA, SCHEMA)))
        return out
    finally:
        consumer.close()


def test_an_outside_writer_and_the_run_agree_on_the_records(
    kafka, kafka_bootstrap: str, run_names: TopicNames
) -> None:  # type: ignore[no-untyped-def]
    run = run_names.run
    write(kafka_bootstrap, run, "http://10.0.0.7:8001", "joined")
    write(kafka_bootstrap, run, "http://10.0.0.8:8001", "joined")
    write(kafka_bootstrap, run, "http://10.0.0.8:8001", "draining")
    members = read_members(kafka, run_names)
    assert {u: m.state.value for u, m in members.items()} == {
        "http://10.0.0.7:8001": "joined",
        "http://10.0.0.8:8001": "draining",
    }
    assert members["http://10.0.0.7:8001"].announced_by == "outside"

    from stream_rl.contracts import MembershipState, ServerMembership

    announce(
        kafka, run_names, ServerMembership(run, "http://10.0.0.7:8001", "vllm", MembershipState.LEFT, "us")
    )
    key, last = read_all(kafka_bootstrap, run)[-1]
    assert key == b"http://10.0.0.7:8001"
    assert {k: last[k] for k in ("run_id", "url", "engine", "state", "announced_by")} == {
        "run_id": run,
        "url": "http://10.0.0.7:8001",
        "engine": "vllm",
        "state": "left",
        "announced_by": "us",
    }


def test_servers_list_shows_the_members_and_join_refuses_a_run_without_the_topic(
    kafka_bootstrap: str, run_names: TopicNames, tmp_path: Path
) -> None:
    run = run_names.run
    write(kafka_bootstrap, run, "http://10.0.0.9:8001", "joined")
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump({"run": run, "kafka": {"bootstrap": kafka_bootstrap}, "inference": {"num_servers": 1}})
    )
    cli = [sys.executable, "-m", "stream_rl.cli", "servers"]
    listing = subprocess.run(
        [*cli, "list", "--config", str(config)], capture_output=True, text=True, cwd=REPO
    )
    assert listing.returncode == 0, listing.stderr
    rows = [line.split()[:3] for line in listing.stdout.splitlines()]
    assert ["http://10.0.0.9:8001", "builtin", "joined"] in rows and [
        "http://127.0.0.1:8100",
        "builtin",
        "configured",
    ] in rows

    config.write_text(yaml.safe_dump({"run": "never-made", "kafka": {"bootstrap": kafka_bootstrap}}))
    res = subprocess.run(
        [*cli, "join", "--config", str(config), "--url", "http://127.0.0.1:1/", "--no-wait"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "topics apply" in res.stderr, res.stderr

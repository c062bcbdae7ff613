"""The foundation against a real Kafka broker: contracts on the wire, DLQ, exactly-once after
SIGKILL, lag, the schemas topic."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakes.records import examples, make_problem, make_rollout
from fastavro import parse_schema, schemaless_reader

from stream_rl.contracts import Problem, Rollout
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.lag import partition_lags, run_lags
from stream_rl.kafka.serde import default_serde, schema_dir
from stream_rl.kafka.stage import Incoming, Output, Reject, StageLoop
from stream_rl.kafka.topics import PROBLEMS, RAW_ROLLOUTS, SCHEMAS, TopicNames, publish_schemas

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent


def read_all(kafka: KafkaTransport, topic: str, expect: int, timeout: float = 20.0) -> list:  # type: ignore[type-arg]
    """Every committed record of a topic (read_committed), waiting for at least `expect`."""
    consumer = kafka.consumer(None, "test-reader")
    parts = kafka.partitions(topic)
    consumer.assign({(topic, p): 0 for p in parts})
    out = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < expect and time.monotonic() < deadline:
            out.extend(consumer.poll_batch(500, 0.5))
        out.extend(consumer.poll_batch(500, 0.5))  # anything beyond `expect` too
    finally:
        consumer.close()
    return out


def test_every_contract_round_trips_through_a_topic(kafka: KafkaTransport, run_names: TopicNames) -> None:
    topic = run_names[PROBLEMS]  # any topic carries bytes; the contract is in the value
    objs = examples()
    p = kafka.producer("test")
    for obj in objs:
        p.produce(topic, default_serde().encode(obj), key=type(obj).__name__, partition=0)  # type: ignore[arg-type]
    p.flush()
    msgs = sorted(read_all(kafka, topic, len(objs)), key=lambda m: m.offset)
    assert len(msgs) == len(objs)
    for obj, msg in zip(objs, msgs, strict=True):
        assert default_serde().decode(msg.value, type(obj)) == obj  # type: ignore[arg-type]
        # Decoded with plain fastavro and the .avsc file alone (no project code):
        raw = json.loads((schema_dir() / f"{obj.SCHEMA}.avsc").read_text())  # type: ignore[attr-defined]
        record = schemaless_reader(io.BytesIO(msg.value[10:]), parse_schema(raw), None)
        assert record == obj.to_dict()  # type: ignore[attr-defined]


def test_schemas_topic_holds_every_schema_by_fingerprint(
    kafka: KafkaTransport, run_names: TopicNames
) -> None:
    publish_schemas(kafka, run_names)
    msgs = read_all(kafka, run_names[SCHEMAS], 5)
    by_key = {m.key.decode(): m.value.decode() for m in msgs}
    for fp, canonical in default_serde().schema_records():
        assert by_key[fp] == canonical


def test_garbage_goes_to_the_dlq_and_the_stage_keeps_running(
    kafka: KafkaTransport, run_names: TopicNames
) -> None:
    inp, out = run_names[PROBLEMS], run_names[RAW_ROLLOUTS]
    p = kafka.producer("test")
    for i in range(10):
        value = b"not avro at all" if i == 4 else default_serde().encode(make_problem(i))
        p.produce(inp, value, key=f"k{i}")
    p.flush()

    def handle(batch: list[Incoming[Problem]]) -> list[Output | Reject]:
        return [Output(out, make_rollout(int(x.value.problem_id[-3:])), key="g") for x in batch]

    loop = StageLoop(
        name="test-stage",
        transport=kafka,
        group=run_names.group("actor"),
        input_topic=inp,
        input_type=Problem,
        handle=handle,
        dlq_topic=run_names.dlq(PROBLEMS),
    )
    stats = loop.run(max_records=10, idle_timeout_s=15)
    assert stats.records_in == 10 and stats.dlq == 1 and stats.records_out == 9
    [bad] = read_all(kafka, run_names.dlq(PROBLEMS), 1)
    assert bad.value == b"not avro at all" and bad.key == b"k4"
    assert b"bad magic" in bad.header("error")
    assert bad.header("original.topic") == inp.encode()
    assert len(read_all(kafka, out, 9)) == 9


def test_transactional_stage_killed_mid_input_outputs_everything_exactly_once(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str
) -> None:
    inp, out = run_names[PROBLEMS], run_names[RAW_ROLLOUTS]
    n = 60
    p = kafka.producer("test")
    for i in range(n):
        p.produce(inp, default_serde().encode(make_problem(i)), key=f"p{i}")
    p.flush()
    group, txn = run_names.group("copy"), f"{run_names.run}.copy.0"
    cmd = [sys.executable, str(HERE / "copy_stage.py"), kafka_bootstrap, inp, out, group, txn, "0.3"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        # Kill it once some, but not all, output is committed.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done = sum(h - lo for lo, h in kafka.watermarks(out).values())
            if done >= 10:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    committed_before = sum(max(o, 0) for o in kafka.group_offsets(group, inp).values())
    assert 0 < committed_before < n, "the kill must land mid-input"
    # Restart under the same transactional id: it fences the dead one and finishes the input.
    res = subprocess.run(cmd[:-1] + ["0"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    msgs = read_all(kafka, out, n)
    ids = [default_serde().decode(m.value, Problem).problem_id for m in msgs]
    assert sorted(ids) == sorted(make_problem(i).problem_id for i in range(n))  # each exactly once


def test_lag_equals_produced_minus_committed(kafka: KafkaTransport, run_names: TopicNames) -> None:
    topic = run_names[RAW_ROLLOUTS]
    group = run_names.group("verifier")
    p = kafka.producer("test")
    for i in range(30):
        p.produce(topic, default_serde().encode(make_rollout(i)), key=f"g{i}")
    p.flush()
    consumer = kafka.consumer(group, "lag-test")
    consumer.assign({(topic, 0): 0, (topic, 1): 0})
    got: list = []  # type: ignore[type-arg]
    deadline = time.monotonic() + 20
    while len(got) < 30 and time.monotonic() < deadline:
        got.extend(consumer.poll_batch(30, 0.5))
    # Commit 7 records of partition 0 and everything of partition 1.
    p0 = sorted(m.offset for m in got if m.partition == 0)
    p1 = sorted(m.offset for m in got if m.partition == 1)
    consumer.commit({(topic, 0): p0[6] + 1, (topic, 1): p1[-1] + 1})
    consumer.close()
    lags = {x.partition: x for x in partition_lags(kafka, group, topic)}
    assert lags[0].lag == len(p0) - 7
    assert lags[1].lag == 0
    assert sum(x.lag for x in lags.values()) == 30 - 7 - len(p1)
    assert lags[0].oldest_age_s is not None and lags[0].oldest_age_s < 120
    assert lags[1].oldest_age_s is None
    # The run-wide report covers every consumer group of the topology.
    groups = {x.group for x in run_lags(kafka, run_names, with_age=False)}
    assert groups == {run_names.group(r) for r in ("actor", "verifier", "preprocessor", "trainer")}


def test_decoded_rollout_from_kafka_is_valid(kafka: KafkaTransport, run_names: TopicNames) -> None:
    r = make_rollout(1, 2, versions=(0, 1, 2))
    p = kafka.producer("test")
    p.produce(run_names[RAW_ROLLOUTS], default_serde().encode(r), key=r.group_id)
    p.flush()
    [msg] = read_all(kafka, run_names[RAW_ROLLOUTS], 1)
    assert default_serde().decode(msg.value, Rollout).version_spans == r.version_spans

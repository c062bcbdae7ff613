"""An outside view of a run: its topics read with confluent-kafka and decoded with the `.avsc`
files and fastavro alone, never the stages' own classes (what a chaos harness in its own clone
would do). Topic names follow the README: `stream-rl.<run>.<topic>`."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import confluent_kafka as ck
from fastavro import parse_schema, schemaless_reader
from fastavro.schema import fingerprint, to_parsing_canonical_form

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


class Decoder:
    """Avro single-object decoding (`C3 01`, 8-byte CRC-64-AVRO fingerprint, body)."""

    def __init__(self, directory: Path = SCHEMAS) -> None:
        self.writers: dict[bytes, tuple[str, Any]] = {}
        for path in [*sorted(directory.glob("*.avsc")), *sorted(directory.glob("released/*/*.avsc"))]:
            raw = json.loads(path.read_text())
            fp = bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), "CRC-64-AVRO"))
            self.writers.setdefault(fp, (raw["name"], parse_schema(raw)))

    def decode(self, data: bytes) -> tuple[str, dict[str, Any]]:
        assert data[:2] == b"\xc3\x01", "not an Avro single object"
        name, schema = self.writers[bytes(data[2:10])]
        return name, schemaless_reader(io.BytesIO(data[10:]), schema)  # type: ignore[call-arg]


def topic(run: str, name: str) -> str:
    return f"stream-rl.{run}.{name}"


def read_topic(bootstrap: str, name: str, timeout: float = 30.0) -> list[tuple[int, int, bytes | None]]:
    """(partition, offset, value) of every committed record, read to the current end."""
    conf = {
        "bootstrap.servers": bootstrap,
        "group.id": "outside-reader",
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "log_level": 0,
    }
    consumer = ck.Consumer(conf)
    try:
        md = consumer.list_topics(name, timeout=10)
        parts = sorted(md.topics[name].partitions)
        ends = {p: consumer.get_watermark_offsets(ck.TopicPartition(name, p), timeout=10)[1] for p in parts}
        wanted = [ck.TopicPartition(name, p, 0) for p in parts if ends[p] > 0]
        if not wanted:
            return []
        consumer.assign(wanted)
        out = []
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in consumer.consume(500, 0.5):
                if m.error() is None and m.offset() < ends[m.partition()]:
                    out.append((m.partition(), m.offset(), m.value()))
            pos = {tp.partition: tp.offset for tp in consumer.position(wanted)}
            if all(pos.get(p, -1) >= ends[p] for p in ends if ends[p] > 0):
                return out
        raise AssertionError(f"could not read {name} to its end in {timeout}s")
    finally:
        consumer.close()


def committed(bootstrap: str, group: str, name: str) -> dict[int, int]:
    """The committed offsets of a consumer group on a topic (-1: none)."""
    consumer = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": group, "log_level": 0})
    try:
        parts = sorted(consumer.list_topics(name, timeout=10).topics[name].partitions)
        res = consumer.committed([ck.TopicPartition(name, p) for p in parts], timeout=10)
        return {r.partition: r.offset for r in res}
    finally:
        consumer.close()


def undecided(bootstrap: str, run: str, groups: tuple[str, ...]) -> list[str]:
    """What Kafka holds undecided for a run, one line each (a stalled nemesis step prints it): the
    partitions whose last stable offset (the read_committed end) stops short of the log end, an open
    transaction there, and the groups whose committed offsets a read_committed client cannot fetch
    (a transactional offset commit still pending on the group coordinator), with what a
    read_uncommitted client reads there."""
    from confluent_kafka.admin import AdminClient, OffsetSpec

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    lines: list[str] = []
    md = admin.list_topics(timeout=10)
    names = sorted(t for t in md.topics if t.startswith(topic(run, "")) or t == "__consumer_offsets")
    for name in names:
        parts = [ck.TopicPartition(name, p) for p in sorted(md.topics[name].partitions)]
        ends: list[dict[int, int | str]] = []
        for level in (ck.IsolationLevel.READ_COMMITTED, ck.IsolationLevel.READ_UNCOMMITTED):
            futs = admin.list_offsets(
                {tp: OffsetSpec.latest() for tp in parts}, isolation_level=level, request_timeout=10
            )
            got: dict[int, int | str] = {}
            for tp, fut in futs.items():
                try:
                    got[tp.partition] = fut.result().offset
                except ck.KafkaException as exc:
                    got[tp.partition] = str(exc)
            ends.append(got)
        for p in sorted(ends[1]):
            if ends[0].get(p) != ends[1][p]:
                lines.append(f"{name}[{p}]: last stable offset {ends[0].get(p)}, log end {ends[1][p]}")
    for group in groups:
        gid = f"stream-rl.{run}.{group}"
        for level in ("read_committed", "read_uncommitted"):
            consumer = ck.Consumer(
                {"bootstrap.servers": bootstrap, "group.id": gid, "isolation.level": level, "log_level": 0}
            )
            try:
                tps = [
                    ck.TopicPartition(t, p)
                    for t in names
                    if not t.startswith("__")
                    for p in md.topics[t].partitions
                ]
                res = consumer.committed(tps, timeout=10)
                offsets = {
                    f"{r.topic.rsplit('.', 1)[-1]}[{r.partition}]": r.offset for r in res if r.offset >= 0
                }
                if level == "read_uncommitted":
                    lines.append(f"group {group}: committed (read_uncommitted) {offsets}")
            except ck.KafkaException as exc:
                lines.append(f"group {group}: committed offsets ({level}): {exc.args[0].str()}")
            finally:
                consumer.close()
    return lines


class VersionWatch:
    """A run's weight versions as they come, read from `weight-versions` outside any group (what
    the chaos and scaling tests act on). The topic is assigned once it exists (the launcher makes
    it after it starts)."""

    def __init__(self, bootstrap: str, run: str, decoder: Decoder) -> None:
        self.decoder = decoder
        self.topic = topic(run, "weight-versions")
        self.consumer = ck.Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "version-watch",
                "enable.auto.commit": False,
                "log_level": 0,
            }
        )
        self.assigned = False
        self.versions: dict[int, dict[str, Any]] = {}
        """version -> its first record."""

    @property
    def newest(self) -> int:
        return max(self.versions, default=-1)

    def poll(self, timeout_s: float = 0.5) -> int:
        """Read what came within `timeout_s`; the newest version seen (-1: none yet)."""
        if not self.assigned:
            try:
                self.consumer.assign([ck.TopicPartition(self.topic, 0, 0)])
                self.assigned = True
            except ck.KafkaException:
                time.sleep(1)
                return self.newest
        for m in self.consumer.consume(100, timeout_s):
            if m.error() is None and m.value():
                wv = self.decoder.decode(m.value())[1]
                self.versions.setdefault(wv["version"], wv)
        return self.newest

    def close(self) -> None:
        self.consumer.close()

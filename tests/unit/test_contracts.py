"""Contracts: Avro single-object encoding, validation, schema evolution."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from fakes.records import examples, make_batch, make_rollout
from fastavro import parse_schema, schemaless_reader
from fastavro.schema import fingerprint, to_parsing_canonical_form

from stream_rl.contracts import CONTRACTS, Rollout, TrainingBatch, VersionSpan, token_versions
from stream_rl.errors import ContractError
from stream_rl.kafka.serde import MAGIC, Serde, schema_dir

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def serde() -> Serde:
    return Serde()


@pytest.mark.parametrize("obj", examples(), ids=lambda o: type(o).__name__)
def test_round_trip(serde: Serde, obj) -> None:  # type: ignore[no-untyped-def]
    data = serde.encode(obj)
    assert data[:2] == MAGIC
    assert serde.decode(data, type(obj)) == obj


@pytest.mark.parametrize("obj", examples(), ids=lambda o: type(o).__name__)
def test_plain_fastavro_decodes_with_the_avsc_alone(serde: Serde, obj) -> None:  # type: ignore[no-untyped-def]
    """What any Avro library can do: check the fingerprint, decode with the .avsc file."""
    raw = json.loads((schema_dir() / f"{obj.SCHEMA}.avsc").read_text())
    data = serde.encode(obj)
    assert data[2:10] == bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), "CRC-64-AVRO"))
    record = schemaless_reader(io.BytesIO(data[10:]), parse_schema(raw), None)
    assert record == obj.to_dict()


def test_fingerprint_is_little_endian_crc64_avro() -> None:
    # Avro spec test vector: the fingerprint of "int" is 0x7275d51a3f395c8f, written little-endian.
    assert fingerprint(to_parsing_canonical_form("int"), "CRC-64-AVRO") == "8f5c393f1ad57572"


def test_every_contract_has_a_schema_file() -> None:
    names = {p.stem for p in schema_dir().glob("*.avsc")}
    assert set(CONTRACTS) <= names


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "bad magic"),
        (b"garbage-not-avro", "bad magic"),
        (MAGIC + b"\x00" * 8 + b"\x01", "unknown schema fingerprint"),
        (None, "tombstone"),
    ],
)
def test_garbage_is_a_contract_error(serde: Serde, data: bytes | None, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        serde.decode(data, Rollout)


def test_truncated_body_is_a_contract_error(serde: Serde) -> None:
    data = serde.encode(make_rollout())
    with pytest.raises(ContractError):
        serde.decode(data[:-5], Rollout)


def test_wrong_record_type_is_rejected(serde: Serde) -> None:
    with pytest.raises(ContractError, match="expected a Rollout record, got TrainingBatch"):
        serde.decode(serde.encode(make_batch()), Rollout)


def test_misaligned_logprobs_are_rejected_on_both_sides(serde: Serde) -> None:
    r = make_rollout(completion_len=6)
    r.logprobs = r.logprobs[:-1]
    with pytest.raises(ContractError, match="5 logprobs for 6 completion tokens"):
        serde.encode(r)


@pytest.mark.parametrize(
    "spans, error",
    [
        ([], "version_spans is empty"),
        ([VersionSpan(0, 1)], "must start at 0"),
        ([VersionSpan(0, 0), VersionSpan(1, 0)], "starts must increase"),
        ([VersionSpan(2, 0), VersionSpan(2, 3)], "same version"),
        ([VersionSpan(0, 0), VersionSpan(1, 8)], "past the end"),
    ],
)
def test_invalid_version_spans(spans: list[VersionSpan], error: str) -> None:
    r = make_rollout(completion_len=8)
    r.version_spans = spans
    with pytest.raises(ContractError, match=error):
        r.validate()


def test_token_versions_expand_spans() -> None:
    assert token_versions([VersionSpan(3, 0), VersionSpan(5, 2)], 5) == [3, 3, 5, 5, 5]


def test_batch_counts_are_checked_on_decode(serde: Serde) -> None:
    batch = make_batch(3)
    d = batch.to_dict()
    d["num_tokens"] += 1
    with pytest.raises(ContractError, match="disagree"):
        TrainingBatch.from_dict(d)


def test_schema_files_are_self_contained() -> None:
    """Each .avsc parses alone (nested records are inlined), so no repository is needed."""
    for path in Path(schema_dir()).glob("*.avsc"):
        parse_schema(json.loads(path.read_text()))

"""Released schemas are frozen, and records written with them stay readable.

`schemas/released/vN/` holds the schemas as released: a record on a topic may have been written
with any of them, so they never change. A schema change edits `schemas/*.avsc` only (backward
compatible: new fields carry a default), and a release adds `schemas/released/vN+1/` with its
digests below. The digest is of the file's bytes, not of the Parsing Canonical Form: that form
drops `default`, which decides how an old record is read.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from fakes.records import examples
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError

from stream_rl.kafka.serde import MAGIC, Serde, load_schema, schema_dir

pytestmark = pytest.mark.unit

RELEASED = schema_dir() / "released"
FROZEN = {
    "v1/EvalResult.avsc": "9421c9ceaa1b2aa23a3bccfee77d607edf5ca505d469b9196f5786e82e33f53c",
    "v1/PartialGroup.avsc": "099cb103b8657b000dce3c8952e5012a019bc9f7aa5a20d790abc3592c3df6e8",
    "v1/Problem.avsc": "1b98805533caacdb38d58039a21bb6f3a2f956f4ebb281eb068d4d0592989982",
    "v1/Rollout.avsc": "36c36ae03f0ef416eacdc7d10fe82a067c5de1185276070f4703a86ed5ccab8d",
    "v1/ScoredRollout.avsc": "cd786c2e67da78b47c81a331dad234c4cc0f19aaa52f7534551b12b25ff932dc",
    "v1/TrainingBatch.avsc": "29e423b7dadb632e0f3b9f5bd18ba29cb4a9944f011acbea84d6eb14b4ac84d4",
    "v1/WeightVersion.avsc": "f953db0c87f408eab25ae72353b41464b06c0c266bf4112559104a79f39eee41",
}
EXAMPLES = {obj.SCHEMA: obj for obj in examples()}  # type: ignore[attr-defined]


def released_files() -> list[Path]:
    return sorted(RELEASED.glob("*/*.avsc"))


def read_with(writer: dict[str, Any], reader: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """`record` written with the `writer` schema, read back with the `reader` schema."""
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(writer), record)
    buf.seek(0)
    out: dict[str, Any] = schemaless_reader(buf, parse_schema(writer), parse_schema(reader))
    return out


def old_record(schema: dict[str, Any]) -> dict[str, Any]:
    """The example record as the `schema` of its type writes it: its fields only, in its order."""
    current = EXAMPLES[schema["name"]].to_dict()
    return {f["name"]: current[f["name"]] if f["name"] in current else f["default"] for f in schema["fields"]}


def test_released_schemas_are_frozen() -> None:
    digests = {
        p.relative_to(RELEASED).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in released_files()
    }
    assert digests == FROZEN, (
        "a released schema never changes: edit schemas/*.avsc (backward compatibly); a release "
        "adds schemas/released/vN+1/ and its digests here"
    )


@pytest.mark.parametrize("path", released_files(), ids=lambda p: p.relative_to(RELEASED).as_posix())
def test_a_record_written_with_a_released_schema_reads_with_the_current_one(path: Path, serde: Serde) -> None:
    old = json.loads(path.read_text())
    current = serde.current[old["name"]].raw
    record = old_record(old)
    read = read_with(old, current, record)
    for field in current["fields"]:
        name = field["name"]
        assert read[name] == (record[name] if name in record else field["default"]), (path, name)
    # As consumers do: the released fingerprint in the header, resolved to the current reader.
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(old), record)
    decoded = serde.decode(
        MAGIC + load_schema(path).fingerprint + buf.getvalue(), type(EXAMPLES[old["name"]])
    )
    assert decoded.to_dict() == read, path


def test_the_evolution_check_fails_on_an_incompatible_change(serde: Serde) -> None:
    old = json.loads((RELEASED / "v1" / "Problem.avsc").read_text())
    record = old_record(old)
    with_default = copy.deepcopy(old)
    with_default["fields"].append({"name": "difficulty", "type": "int", "default": 3})
    assert read_with(old, with_default, record)["difficulty"] == 3
    without_default = copy.deepcopy(old)
    without_default["fields"].append({"name": "difficulty", "type": "int"})
    with pytest.raises(SchemaResolutionError):
        read_with(old, without_default, record)
    retyped = copy.deepcopy(old)
    next(f for f in retyped["fields"] if f["name"] == "epoch")["type"] = "string"
    with pytest.raises(SchemaResolutionError):
        read_with(old, retyped, record)


@pytest.fixture(scope="module")
def serde() -> Serde:
    return Serde()

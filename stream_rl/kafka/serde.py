"""Avro single-object encoding of the contracts (the Avro spec, "Single object encoding").

Wire format of every record value: `C3 01` + the 8-byte little-endian CRC-64-AVRO fingerprint
of the writer schema's Parsing Canonical Form + the Avro binary body. Any Avro library can
decode a record with the `.avsc` file alone; the schemas are also published to the compacted
`_schemas` topic keyed by fingerprint (hex), so consumers need not have this repository.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint, to_parsing_canonical_form

from stream_rl.contracts import CONTRACTS, Contract
from stream_rl.errors import ContractError

MAGIC = b"\xc3\x01"
HEADER_LEN = 10
SCHEMA_DIR_ENV = "STREAM_RL_SCHEMA_DIR"

T = TypeVar("T", bound=Contract)


def schema_dir() -> Path:
    """`schemas/` at the repository root (or $STREAM_RL_SCHEMA_DIR)."""
    env = os.environ.get(SCHEMA_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "schemas"


@dataclass(frozen=True)
class Schema:
    name: str
    raw: dict[str, Any]
    parsed: Any
    canonical: str
    fingerprint: bytes
    """8 bytes, little-endian CRC-64-AVRO of the canonical form."""

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()


def load_schema(path: Path) -> Schema:
    raw = json.loads(path.read_text())
    parsed = parse_schema(raw)
    canonical = to_parsing_canonical_form(raw)
    fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
    return Schema(name=raw["name"], raw=raw, parsed=parsed, canonical=canonical, fingerprint=fp)


class Serde:
    """Encodes and decodes contract objects. Decoding accepts any known writer schema
    (current or released) and resolves it to the current reader schema."""

    def __init__(self, directory: Path | None = None) -> None:
        directory = directory or schema_dir()
        if not directory.is_dir():
            raise ContractError(f"schema directory {directory} not found (set ${SCHEMA_DIR_ENV})")
        self.current: dict[str, Schema] = {}
        self.by_fingerprint: dict[bytes, Schema] = {}
        for path in sorted(directory.glob("*.avsc")):
            schema = load_schema(path)
            self.current[schema.name] = schema
            self.by_fingerprint[schema.fingerprint] = schema
        released = directory / "released"
        if released.is_dir():
            for path in sorted(released.glob("*/*.avsc")):
                schema = load_schema(path)
                self.by_fingerprint.setdefault(schema.fingerprint, schema)
        missing = set(CONTRACTS) - set(self.current)
        if missing:
            raise ContractError(f"no .avsc for contracts {sorted(missing)} in {directory}")

    def encode(self, obj: Contract) -> bytes:
        """Validate and encode a contract object as an Avro single object."""
        schema = self.current[obj.SCHEMA]
        obj.validate()
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(schema.fingerprint)
        try:
            schemaless_writer(buf, schema.parsed, obj.to_dict())
        except (ValueError, TypeError, KeyError, OverflowError) as exc:
            raise ContractError(f"{obj.SCHEMA} does not match its schema: {exc}") from exc
        return buf.getvalue()

    def decode(self, data: bytes | None, cls: type[T]) -> T:
        """Decode and validate bytes written with any known version of `cls`'s schema."""
        if data is None:
            raise ContractError(f"{cls.SCHEMA}: record has no value (tombstone)")
        if len(data) < HEADER_LEN or data[:2] != MAGIC:
            raise ContractError(f"{cls.SCHEMA}: not an Avro single-object record (bad magic)")
        writer = self.by_fingerprint.get(bytes(data[2:HEADER_LEN]))
        if writer is None:
            raise ContractError(f"{cls.SCHEMA}: unknown schema fingerprint {bytes(data[2:10]).hex()}")
        if writer.name != cls.SCHEMA:
            raise ContractError(f"expected a {cls.SCHEMA} record, got {writer.name}")
        reader = self.current[cls.SCHEMA]
        try:
            body = io.BytesIO(data[HEADER_LEN:])
            record = schemaless_reader(body, writer.parsed, reader.parsed)
            if body.tell() != len(data) - HEADER_LEN:
                raise ContractError(f"{cls.SCHEMA}: {len(data) - HEADER_LEN - body.tell()} trailing bytes")
            obj = cls.from_dict(record)  # type: ignore[arg-type]
        except ContractError:
            raise
        except (
            ValueError,
            TypeError,
            KeyError,
            EOFError,
            IndexError,
            OverflowError,
            UnicodeDecodeError,
        ) as exc:
            raise ContractError(f"{cls.SCHEMA}: undecodable record: {exc!r}") from exc
        obj.validate()
        return obj

    def schema_records(self) -> list[tuple[str, str]]:
        """(fingerprint hex, canonical schema JSON) of every current schema, for `_schemas`."""
        return [(s.fingerprint_hex, s.canonical) for s in self.current.values()]


@lru_cache(maxsize=1)
def default_serde() -> Serde:
    return Serde()

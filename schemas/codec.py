"""Avro records in the Confluent wire format: magic byte 0, 4-byte big-endian schema id, Avro binary body.

The codec speaks plain Avro values: timestamp fields are integers (microseconds since the
epoch), as their `_us` names say. Logical types stay in the schemas for other readers.
"""

from __future__ import annotations

import reprlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from io import BytesIO
from typing import Any, cast

import fastavro
from fastavro.read import SchemaResolutionError
from fastavro.validation import ValidationError, validate

from .catalog import SPAN_BATCH, Schema, current_schemas, full_name, self_contained
from .errors import EncodeError, IncompatibleSchema, MalformedRecord, NotWireFormat, UnknownRecordName
from .records import SpanRecord
from .schema_ids import SchemaRegistry, default_registry, schema_id
from .unions import BranchTagger, branch_tagger

MAGIC_BYTE = 0
_HEADER = struct.Struct(">BI")
HEADER_SIZE = _HEADER.size


@dataclass(frozen=True, slots=True)
class _PreparedSchema:
    """A schema ready for fastavro: logical types dropped, union branches taggable, content address known."""

    name: str
    content_id: int
    plain: Schema
    tag_branches: BranchTagger | None

    @classmethod
    def of(cls, schema: Schema) -> _PreparedSchema:
        plain = self_contained(schema, logical_types=False)
        return cls(schema["name"], schema_id(schema), plain, branch_tagger(plain))


class AvroCodec:
    """Encodes record dicts to wire-format bytes and back, caching every schema it has prepared.

    Records are named by their full name (`io.agentstream.v1.Span`) or by their name in the
    current namespace (`Span`); a schema dict works too, but is prepared again on every call.
    """

    def __init__(self, registry: SchemaRegistry | None = None) -> None:
        self._registry: SchemaRegistry = registry if registry is not None else default_registry()
        self._writers: dict[str, tuple[bytes, _PreparedSchema]] = {}
        self._readers: dict[str, _PreparedSchema] = {}
        self._by_id: dict[int, _PreparedSchema] = {}

    def encode(self, schema: str | Mapping[str, Any], value: Mapping[str, Any]) -> bytes:
        """Wire-format bytes of `value` written with `schema` (a record name or a schema dict)."""
        header, writer = self._writer(schema)
        buffer = BytesIO()
        buffer.write(header)
        try:
            tagged = value if writer.tag_branches is None else writer.tag_branches(value)
            fastavro.schemaless_writer(buffer, writer.plain, tagged, strict_allow_default=True)
        except Exception as error:
            raise EncodeError(_explain_mismatch(value, writer, error)) from error
        return buffer.getvalue()

    def encode_span_batch(self, spans: Sequence[SpanRecord]) -> bytes:
        """Wire-format bytes of one SpanBatch holding `spans`."""
        return self.encode(SPAN_BATCH, {"spans": spans})

    def decode(self, data: bytes, reader_schema: str | Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """The writer's record full name and the value in `data`, read as `reader_schema` when one is given."""
        writer_id, writer = self._writer_of(data)
        reader = None if reader_schema is None else self._reader(reader_schema)
        resolve_to = None if reader is None or reader.content_id == writer.content_id else reader.plain
        buffer = BytesIO(data)
        buffer.seek(HEADER_SIZE)
        try:
            value = fastavro.schemaless_reader(buffer, writer.plain, resolve_to)
        except SchemaResolutionError as error:
            raise IncompatibleSchema(
                f"reader schema cannot read {writer.name} (schema id {writer_id}): {error}"
            ) from error
        except Exception as error:
            raise MalformedRecord(f"cannot read {writer.name} (schema id {writer_id}): {error!r}") from error
        if buffer.tell() != len(data):
            raise MalformedRecord(f"{len(data) - buffer.tell()} bytes left after {writer.name} (schema id {writer_id})")
        return writer.name, cast(dict[str, Any], value)

    def header(self, schema: str) -> bytes:
        """The 5-byte wire-format header of records written with the bundled schema ``schema``."""
        return self._writer(schema)[0]

    def writer_schema(self, data: bytes) -> tuple[int, str, Schema]:
        """The schema id, record full name and plain writer schema (no logical types) of a wire-format record."""
        writer_id, writer = self._writer_of(data)
        return writer_id, writer.name, writer.plain

    def _writer_of(self, data: bytes) -> tuple[int, _PreparedSchema]:
        """The schema id and writer schema named by a record's header; a tombstone (no value) is not wire format."""
        if data is None:
            raise NotWireFormat("the record has no value (a tombstone): nothing to decode")
        if len(data) < HEADER_SIZE:
            raise NotWireFormat(f"{len(data)} bytes is shorter than the {HEADER_SIZE}-byte header")
        magic, writer_id = _HEADER.unpack_from(data)
        if magic != MAGIC_BYTE:
            raise NotWireFormat(f"magic byte is {magic}, expected {MAGIC_BYTE}")
        return writer_id, self._by_id.get(writer_id) or self._writer_by_id(writer_id)

    def _writer(self, schema: str | Mapping[str, Any]) -> tuple[bytes, _PreparedSchema]:
        """The header and schema to encode with; registered with the registry once per record name."""
        if isinstance(schema, str) and schema in self._writers:
            return self._writers[schema]
        full_schema = _bundled(schema) if isinstance(schema, str) else self_contained(schema)
        writer = _HEADER.pack(MAGIC_BYTE, self._registry.register(full_schema)), _PreparedSchema.of(full_schema)
        if isinstance(schema, str):
            self._writers[schema] = writer
        return writer

    def _writer_by_id(self, writer_id: int) -> _PreparedSchema:
        writer = self._by_id[writer_id] = _PreparedSchema.of(self._registry.lookup(writer_id))
        return writer

    def _reader(self, schema: str | Mapping[str, Any]) -> _PreparedSchema:
        if not isinstance(schema, str):
            return _PreparedSchema.of(self_contained(schema))
        if schema not in self._readers:
            self._readers[schema] = _PreparedSchema.of(_bundled(schema))
        return self._readers[schema]


def _bundled(record_name: str) -> Schema:
    try:
        return current_schemas()[full_name(record_name)]
    except KeyError:
        raise UnknownRecordName(f"no bundled schema for record {record_name!r}") from None


def _explain_mismatch(value: Any, writer: _PreparedSchema, error: Exception) -> str:
    """Name the offending fields when fastavro's validator can; otherwise keep the writer's own message."""
    try:
        validate(value, writer.plain, raise_errors=True)
    except ValidationError as invalid:
        problems = (
            f"{problem.field or writer.name} is {reprlib.repr(problem.datum)}, expected {_type_name(problem.schema)}"
            for problem in invalid.errors
        )
        return f"{writer.name} does not match: " + "; ".join(problems)
    except Exception:  # the validator trips over some values the writer rejected: the writer's message stands
        pass
    return f"{writer.name} does not match: {error}"


def _type_name(schema: Any) -> str:
    if isinstance(schema, list):
        return " or ".join(map(_type_name, schema))
    if isinstance(schema, dict):
        return str(schema.get("name", schema["type"]))
    return str(schema)

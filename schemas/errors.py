"""Errors of the Avro codec, all subclasses of `CodecError` so callers can dead-letter with one except."""

from __future__ import annotations


class CodecError(Exception):
    """Base class: any failure to encode or decode an agentstream record."""


class NotWireFormat(CodecError):
    """The bytes are not in the Confluent wire format (empty, shorter than the header, or bad magic byte)."""


class UnknownSchemaId(CodecError):
    """The schema id in the header is unknown to the registry, so the body cannot be read."""

    def __init__(self, schema_id: int) -> None:
        super().__init__(schema_id)
        self.schema_id = schema_id

    def __str__(self) -> str:
        return f"unknown schema id {self.schema_id}"


class MalformedRecord(CodecError):
    """The Avro body is truncated, garbage, or followed by trailing bytes."""


class IncompatibleSchema(CodecError):
    """The reader schema cannot read data written with the writer schema (Avro schema resolution failed)."""


class SchemaIdCollision(CodecError):
    """Two different schemas hash to the same content-addressed id."""


class UnknownRecordName(CodecError):
    """No bundled schema has this record name."""


class EncodeError(CodecError):
    """The value does not match the schema it is encoded with."""

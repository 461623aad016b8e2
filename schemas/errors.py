"""The root of agentstream's errors, and the errors of the Avro codec.

Every exception the product packages raise derives from :class:`AgentstreamError`. The codec's
errors are all subclasses of :class:`CodecError`, so callers can dead-letter with one except.
"""

from __future__ import annotations


class AgentstreamError(Exception):
    """Base class of every error agentstream raises, so a caller can catch them all with one except.

    ``retriable`` is a promise about the class, in the sense of aiokafka's errors. True: the
    failure is transient (a broker, ClickHouse, store or upstream that cannot be reached or is
    busy now, a full buffer, a timeout) and the same call, made again later, may succeed.
    False: the call itself is wrong (bad input, a missing file, a refused key, a setting that
    cannot work) and repeating it gives the same error. It does not say how long to wait or how
    often to try; that is the caller's policy.
    """

    retriable: bool = False


class CodecError(AgentstreamError):
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

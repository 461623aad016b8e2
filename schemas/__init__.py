"""Avro schemas of every agentstream Kafka record, and the codec for their Confluent wire format."""

from .catalog import (
    CHECKPOINT,
    DEAD_LETTER,
    NAMESPACE,
    ROLLOUT_EVENT,
    ROLLOUT_RESULT,
    SPAN,
    SPAN_BATCH,
    TASK,
    TRANSITION,
    Schema,
    current_schemas,
    history_schemas,
    self_contained,
)
from .codec import HEADER_SIZE, MAGIC_BYTE, AvroCodec
from .errors import (
    CodecError,
    EncodeError,
    IncompatibleSchema,
    MalformedRecord,
    NotWireFormat,
    SchemaIdCollision,
    UnknownRecordName,
    UnknownSchemaId,
)
from .registry import BundledRegistry, SchemaRegistry, schema_id

__all__ = [
    "CHECKPOINT",
    "DEAD_LETTER",
    "HEADER_SIZE",
    "MAGIC_BYTE",
    "NAMESPACE",
    "ROLLOUT_EVENT",
    "ROLLOUT_RESULT",
    "SPAN",
    "SPAN_BATCH",
    "TASK",
    "TRANSITION",
    "AvroCodec",
    "BundledRegistry",
    "CodecError",
    "EncodeError",
    "IncompatibleSchema",
    "MalformedRecord",
    "NotWireFormat",
    "Schema",
    "SchemaIdCollision",
    "SchemaRegistry",
    "UnknownRecordName",
    "UnknownSchemaId",
    "current_schemas",
    "history_schemas",
    "schema_id",
    "self_contained",
]

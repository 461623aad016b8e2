"""Sorting raw records of the spans topic by what they carry, reading only the 5-byte header.

Span batches stay undecoded (ClickHouse decodes them); rollout events are small and decoded
here; anything that is not a record we know is a dead letter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from agentstream.schemas import AvroCodec, CodecError
from agentstream.schemas.records import RolloutEventRecord

SPAN_BATCH = "io.agentstream.v1.SpanBatch"
SPAN = "io.agentstream.v1.Span"
ROLLOUT_EVENT = "io.agentstream.v1.RolloutEvent"


@dataclass
class RawRecord:
    """One Kafka record as the processor sees it: where it came from, its key and value bytes."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    handle: Any = None  # the framework's event, acknowledged when the record is fully processed


@dataclass
class Sorted:
    """A batch split by kind: span bodies grouped by writer schema id, decoded events, dead letters."""

    span_bodies: dict[int, list[tuple[RawRecord, bytes]]] = field(default_factory=dict)
    schemas: dict[int, dict] = field(default_factory=dict)
    events: list[tuple[RawRecord, RolloutEventRecord]] = field(default_factory=list)
    dead: list[tuple[RawRecord, Exception]] = field(default_factory=list)


class UnexpectedRecord(CodecError):
    """A well-formed Avro record of a type the spans topic should not carry."""


def sort_records(records: list[RawRecord], codec: AvroCodec) -> Sorted:
    """Classify every record; nothing raises, a bad record becomes a dead letter with its reason."""
    out = Sorted()
    for record in records:
        try:
            schema_id, name, schema = codec.writer_schema(record.value)
            if name in (SPAN_BATCH, SPAN):
                if not record.key:
                    raise UnexpectedRecord("span record without a key: the key must be the rollout id")
                body = record.value[5:]
                if name == SPAN:  # a lone Span is a SpanBatch of one: array block of 1 item, then the end block
                    body, schema = b"\x02" + body + b"\x00", _batch_of(schema)
                out.span_bodies.setdefault(schema_id, []).append((record, body))
                out.schemas[schema_id] = schema
            elif name == ROLLOUT_EVENT:
                out.events.append((record, cast(RolloutEventRecord, codec.decode(record.value)[1])))
            else:
                raise UnexpectedRecord(f"{name} records do not belong on the spans topic")
        except CodecError as error:
            out.dead.append((record, error))
    return out


def _batch_of(span_schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "record", "name": "SpanBatch", "namespace": "io.agentstream.v1",
            "fields": [{"name": "spans", "type": {"type": "array", "items": span_schema}}]}

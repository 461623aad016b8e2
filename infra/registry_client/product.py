"""The product's schemas as a registry holds them: one subject per record (its full name), history first."""

from __future__ import annotations

from agentstream.schemas.catalog import Schema, current_schemas, history_schemas


def subject_of(schema: Schema) -> str:
    """The subject of a record schema: its full name (Confluent's RecordNameStrategy).

    One topic carries several record types (the spans topic holds SpanBatch, Span and
    RolloutEvent records), so subjects follow records, not topics.
    """
    return str(schema["name"])


def product_schemas(history: bool = True) -> list[tuple[str, Schema]]:
    """(subject, schema) for every record agentstream writes: retired versions first, then the current ones."""
    retired = [(subject_of(schema), schema) for schema in history_schemas()] if history else []
    return retired + [(subject_of(schema), schema) for _, schema in sorted(current_schemas().items())]

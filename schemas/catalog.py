"""The Avro schemas shipped in `schemas/avro/`, parsed into self-contained fastavro schemas."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from types import MappingProxyType
from typing import Any, cast

import fastavro
from fastavro.schema import UnknownType

Schema = dict[str, Any]
"""A parsed fastavro schema that defines every named type it uses (no reference to another schema)."""

NAMESPACE = "io.agentstream.v1"
SPAN = f"{NAMESPACE}.Span"
SPAN_BATCH = f"{NAMESPACE}.SpanBatch"
TASK = f"{NAMESPACE}.Task"
ROLLOUT_EVENT = f"{NAMESPACE}.RolloutEvent"
TRANSITION = f"{NAMESPACE}.Transition"
TRANSITION_BATCH = f"{NAMESPACE}.TransitionBatch"
CHECKPOINT = f"{NAMESPACE}.Checkpoint"
DEAD_LETTER = f"{NAMESPACE}.DeadLetter"
ROLLOUT_RESULT = f"{NAMESPACE}.RolloutResult"
DEPLOYMENT = f"{NAMESPACE}.Deployment"
ANNOUNCEMENT = f"{NAMESPACE}.Announcement"

_AVRO_DIR = resources.files("agentstream.schemas") / "avro"
_HISTORY_DIR = _AVRO_DIR / "history"


def full_name(record_name: str) -> str:
    """Full name of a record: names without a namespace are in the current one (`Span` -> `io.agentstream.v1.Span`)."""
    return record_name if "." in record_name else f"{NAMESPACE}.{record_name}"


@functools.cache
def current_schemas() -> Mapping[str, Schema]:
    """The current schema of every record, by full name; these files may refer to each other's named types."""
    parsed = _parse_together([_read_json(path) for path in _avsc_files(_AVRO_DIR)])
    return MappingProxyType({schema["name"]: self_contained(schema) for schema in parsed})


@functools.cache
def history_schemas() -> tuple[Schema, ...]:
    """Retired schema versions kept so old records stay readable; each file stands alone."""
    return tuple(self_contained(_read_json(path)) for path in _avsc_files(_HISTORY_DIR))


def self_contained(schema: Mapping[str, Any], *, logical_types: bool = True) -> Schema:
    """Parse `schema` (raw or parsed) into the form a registry stores: named types defined at first use, named after.

    `logical_types=False` drops the logical-type annotations, so fastavro reads and writes the
    underlying primitive values (the id does not change: the canonical form ignores them).
    """
    parsed = cast(Schema, fastavro.parse_schema(dict(schema)))
    dropped = frozenset() if logical_types else frozenset({"logicalType"})
    inlined = _inline_named_types(parsed, parsed.get("__named_schemas", {}), set(), dropped)
    return cast(Schema, fastavro.parse_schema(inlined))


def _avsc_files(directory: Traversable) -> list[Traversable]:
    if not directory.is_dir():
        return []
    return sorted((entry for entry in directory.iterdir() if entry.name.endswith(".avsc")), key=lambda e: e.name)


def _read_json(path: Traversable) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _parse_together(raw_schemas: list[Any]) -> list[Schema]:
    """Parse schemas that refer to each other's named types, whatever order they come in."""
    named: dict[str, Schema] = {}
    parsed: list[Schema] = []
    pending = raw_schemas
    while pending:
        waiting, unresolved = [], []
        for raw in pending:
            attempt = dict(named)  # a failed parse leaves half its types behind
            try:
                parsed.append(cast(Schema, fastavro.parse_schema(raw, named_schemas=attempt)))
            except UnknownType as error:
                waiting.append(raw)
                unresolved.append(error)
            else:
                named = attempt
        if len(waiting) == len(pending):
            raise unresolved[0]
        pending = waiting
    return parsed


def schema_json(schema: Schema) -> str:
    """The JSON text of a parsed schema as a registry stores it, and as the compiled reader takes it (fastavro's
    private keys left out: its ``__named_schemas`` refers back to the schema)."""
    return json.dumps(_public(schema), separators=(",", ":"))


def _public(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _public(value) for key, value in node.items() if not key.startswith("__")}
    if isinstance(node, list):
        return [_public(item) for item in node]
    return node


def _inline_named_types(schema: Any, known: Mapping[str, Any], defined: set[str], dropped: frozenset[str]) -> Any:
    """Copy of `schema` with each named type inlined at its first use, minus fastavro's private keys and `dropped`."""
    if isinstance(schema, str):
        if schema in known and schema not in defined:
            return _inline_named_types(known[schema], known, defined, dropped)
        return schema
    if isinstance(schema, list):
        return [_inline_named_types(branch, known, defined, dropped) for branch in schema]
    copy = {key: value for key, value in schema.items() if not key.startswith("__") and key not in dropped}
    if "name" in schema:
        defined.add(schema["name"])
    kind = schema["type"]
    if kind in ("record", "error"):
        copy["fields"] = [
            {**field, "type": _inline_named_types(field["type"], known, defined, dropped)} for field in schema["fields"]
        ]
    elif kind == "array":
        copy["items"] = _inline_named_types(schema["items"], known, defined, dropped)
    elif kind == "map":
        copy["values"] = _inline_named_types(schema["values"], known, defined, dropped)
    return copy

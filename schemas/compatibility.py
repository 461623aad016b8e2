"""Avro schema compatibility: can data written with one schema be read with another (Avro's resolution rules)?

This is what a schema registry checks before it accepts a new version of a subject. The
levels are Confluent's: ``BACKWARD`` (the new schema reads data written with the latest one),
``FORWARD`` (the latest reads data written with the new one), ``FULL`` (both), each with a
``_TRANSITIVE`` variant that checks every earlier version instead of the latest only, and
``NONE``.

The reader/writer check follows the Avro specification's schema resolution: matching
primitive types or a promotion (int to long, float or double; long to float or double; float
to double; string to and from bytes), records matched by name or reader alias with every
reader field either present in the writer (or named by an alias) or given a default, enum
symbols of the writer known to the reader (or a reader default symbol), fixed sizes equal,
arrays and maps by their items and values, and unions branch by branch. Logical types,
docs and field order do not matter. Each problem is reported with the path where it lies,
e.g. ``/fields/kind/type/symbols: reader lacks writer symbols ['NEW']``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import fastavro

from agentstream.schemas.errors import AgentstreamError

LEVELS = ("BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL", "FULL_TRANSITIVE", "NONE")
"""The compatibility levels, as Confluent's Schema Registry names them."""

PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_PROMOTIONS: Mapping[str, frozenset[str]] = {
    "int": frozenset({"long", "float", "double"}),
    "long": frozenset({"float", "double"}),
    "float": frozenset({"double"}),
    "string": frozenset({"bytes"}),
    "bytes": frozenset({"string"}),
}


class InvalidSchema(AgentstreamError, ValueError):
    """The text is not JSON, or the JSON is not a valid Avro schema."""


class UnknownCompatibilityLevel(AgentstreamError, ValueError):
    """A compatibility level other than those in :data:`LEVELS`."""


@dataclass(frozen=True)
class ParsedSchema:
    """An Avro schema parsed for comparison: the root (named types by full name) and every named type it defines."""

    root: Any
    named: Mapping[str, Any]


@dataclass
class Verdict:
    """The outcome of a check: compatible when ``problems`` is empty; each problem names its path."""

    problems: list[str] = field(default_factory=list)

    @property
    def compatible(self) -> bool:
        return not self.problems


def parse(schema: str | Mapping[str, Any] | list[Any]) -> ParsedSchema:
    """Parse a schema (JSON text or an already decoded object); raise :class:`InvalidSchema` when it is not Avro."""
    try:
        document = json.loads(schema) if isinstance(schema, str) else schema
    except json.JSONDecodeError as error:
        raise InvalidSchema(f"schema is not JSON: {error}") from None
    named: dict[str, Any] = {}
    try:
        root = fastavro.parse_schema(cast(Any, document), named_schemas=named, _write_hint=False, _force=True)
    except Exception as error:  # fastavro raises several types (SchemaParseException, UnknownType, KeyError, ...)
        raise InvalidSchema(f"not a valid Avro schema: {error}") from None
    return ParsedSchema(root, named)


def check_level(level: str) -> str:
    """The level in upper case, or :class:`UnknownCompatibilityLevel`."""
    normalised = level.strip().upper() if isinstance(level, str) else ""
    if normalised not in LEVELS:
        raise UnknownCompatibilityLevel(f"compatibility level must be one of {', '.join(LEVELS)}, got {level!r}")
    return normalised


def can_read(reader: ParsedSchema, writer: ParsedSchema) -> Verdict:
    """Whether data written with ``writer`` can be read with ``reader``, and if not, why."""
    verdict = Verdict()
    _Resolution(reader.named, writer.named, verdict.problems).check(reader.root, writer.root, "")
    return verdict


def check(new: ParsedSchema, earlier: Iterable[ParsedSchema], level: str) -> Verdict:
    """Whether ``new`` may follow ``earlier`` (oldest first) under ``level``; problems say which version fails how."""
    level = check_level(level)
    versions = list(earlier)
    if level == "NONE" or not versions:
        return Verdict()
    against = versions if level.endswith("_TRANSITIVE") else versions[-1:]
    verdict = Verdict()
    for index, old in enumerate(reversed(against)):
        label = "the latest version" if index == 0 else f"version {len(against) - index} of those checked"
        if level.startswith(("BACKWARD", "FULL")):
            verdict.problems += [f"the new schema cannot read data written with {label}: {problem}"
                                 for problem in can_read(new, old).problems]
        if level.startswith(("FORWARD", "FULL")):
            verdict.problems += [f"{label} cannot read data written with the new schema: {problem}"
                                 for problem in can_read(old, new).problems]
    return verdict


def _kind(schema: Any) -> str:
    if isinstance(schema, list):
        return "union"
    if isinstance(schema, dict):
        return str(schema["type"])
    return str(schema)


def _short(name: str) -> str:
    return name.rpartition(".")[2]


class _Resolution:
    """One reader/writer comparison; remembers the named pairs it is checking so recursive types terminate."""

    def __init__(self, reader_named: Mapping[str, Any], writer_named: Mapping[str, Any], problems: list[str]) -> None:
        self.reader_named = reader_named
        self.writer_named = writer_named
        self.problems = problems
        self.in_progress: set[tuple[str, str]] = set()

    def check(self, reader: Any, writer: Any, path: str) -> None:
        reader, writer = self._resolve(reader, self.reader_named), self._resolve(writer, self.writer_named)
        reader_kind, writer_kind = _kind(reader), _kind(writer)
        if writer_kind == "union":
            for index, branch in enumerate(writer):
                self.check(reader, branch, f"{path}/{index}")
            return
        if reader_kind == "union":
            if not any(self._fits(branch, writer) for branch in reader):
                self.problems.append(f"{path or '/'}: reader union {self._describe(reader)} has no branch for "
                                     f"writer type {self._describe(writer)}")
            return
        if reader_kind != writer_kind:
            if reader_kind in _PROMOTIONS.get(writer_kind, frozenset()):
                return
            self.problems.append(f"{path or '/'}: reader type {self._describe(reader)} cannot read writer type "
                                 f"{self._describe(writer)}")
            return
        if reader_kind in PRIMITIVES:
            return
        if reader_kind == "array":
            self.check(reader["items"], writer["items"], f"{path}/items")
        elif reader_kind == "map":
            self.check(reader["values"], writer["values"], f"{path}/values")
        elif reader_kind in ("record", "error", "enum", "fixed"):
            self._named(reader, writer, path)

    def _named(self, reader: dict[str, Any], writer: dict[str, Any], path: str) -> None:
        if not self._same_name(reader, writer):
            self.problems.append(f"{path}/name: reader {reader['name']} does not name writer {writer['name']} "
                                 f"(neither its name nor an alias)")
            return
        kind = reader["type"]
        if kind == "fixed":
            if reader["size"] != writer["size"]:
                self.problems.append(f"{path}/size: reader size {reader['size']}, writer size {writer['size']}")
        elif kind == "enum":
            missing = [symbol for symbol in writer["symbols"] if symbol not in reader["symbols"]]
            if missing and reader.get("default") is None:
                self.problems.append(f"{path}/symbols: reader lacks writer symbols {missing} and has no default")
        else:
            pair = (reader["name"], writer["name"])
            if pair in self.in_progress:
                return
            self.in_progress.add(pair)
            writer_fields = {f["name"]: f for f in writer["fields"]}
            for reader_field in reader["fields"]:
                names = (reader_field["name"], *reader_field.get("aliases", ()))
                match = next((writer_fields[name] for name in names if name in writer_fields), None)
                where = f"{path}/fields/{reader_field['name']}"
                if match is not None:
                    self.check(reader_field["type"], match["type"], f"{where}/type")
                elif "default" not in reader_field:
                    self.problems.append(f"{where}: reader field is missing from the writer and has no default")
            self.in_progress.discard(pair)

    def _fits(self, reader: Any, writer: Any) -> bool:
        """Whether a reader branch reads the writer type (checked quietly)."""
        trial = _Resolution(self.reader_named, self.writer_named, [])
        trial.in_progress = set(self.in_progress)
        trial.check(reader, writer, "")
        return not trial.problems

    @staticmethod
    def _same_name(reader: dict[str, Any], writer: dict[str, Any]) -> bool:
        if _short(reader["name"]) == _short(writer["name"]):
            return True
        aliases = reader.get("aliases", ())
        return writer["name"] in aliases or _short(writer["name"]) in {_short(alias) for alias in aliases}

    @staticmethod
    def _resolve(schema: Any, named: Mapping[str, Any]) -> Any:
        if isinstance(schema, str) and schema not in PRIMITIVES:
            return named.get(schema, schema)
        if isinstance(schema, dict) and schema.get("type") in PRIMITIVES:
            return schema["type"]  # {"type": "long", "logicalType": ...} reads as long
        return schema

    def _describe(self, schema: Any) -> str:
        if isinstance(schema, list):
            return "[" + ", ".join(self._describe(self._resolve(b, self.reader_named)) for b in schema) + "]"
        if isinstance(schema, dict):
            return str(schema.get("name", schema["type"]))
        return str(schema)

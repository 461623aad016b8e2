"""What a Schema Registry knows, rebuilt from its log: subjects, versions, schemas by id, compatibility levels.

The state changes only by :meth:`RegistryState.apply`, one log record at a time, so every
registry reading the same topic ends up with the same state. A write is planned against the
state (:meth:`RegistryState.plan_register`), appended to the log, and becomes visible when
the log record comes back and is applied.

Log records use the layout of Confluent's ``_schemas`` topic: JSON keys
``{"keytype": "SCHEMA", "subject", "version", "magic": 1}`` with values
``{"subject", "version", "id", "schema", "deleted"}``, ``{"keytype": "CONFIG", "subject",
"magic": 0}`` with ``{"compatibilityLevel"}``, and ``NOOP`` markers; a null value deletes.

Ids are either ``fingerprint`` (a schema's id is the content address agentstream's codec
writes, :func:`schemas.registry.id_of_canonical_form`, so producers need no round trip) or
``sequential`` (1, 2, 3, ... as Confluent assigns them). Either way one schema has one id
across all subjects, and schemas are the same when their Avro Parsing Canonical Forms are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastavro.schema import to_parsing_canonical_form

from infra.schema_registry.errors import (
    IncompatibleSchemaVersion,
    InvalidCompatibilityLevel,
    InvalidSchemaError,
    InvalidVersion,
    SchemaNotFound,
    SubjectLevelConfigNotFound,
    SubjectNotFound,
    VersionNotFound,
)
from schemas.compatibility import InvalidSchema, ParsedSchema, UnknownCompatibilityLevel, Verdict, check, check_level
from schemas.compatibility import parse as parse_avro
from schemas.registry import id_of_canonical_form

ID_STRATEGIES = ("fingerprint", "sequential")
MAX_VERSION = 2**31 - 1
LogKey = dict[str, Any]
LogValue = dict[str, Any] | None


@dataclass(frozen=True)
class SchemaVersion:
    """One version of a subject."""

    subject: str
    version: int
    id: int
    schema: str
    deleted: bool = False

    def body(self) -> dict[str, Any]:
        """The JSON Confluent answers for a version (AVRO, the default type, is not named)."""
        return {"subject": self.subject, "version": self.version, "id": self.id, "schema": self.schema}


@dataclass(frozen=True)
class Candidate:
    """A schema checked and normalised for registration: its JSON text, canonical form and parsed form."""

    text: str
    canonical: str
    parsed: ParsedSchema


def schema_key(subject: str, version: int) -> LogKey:
    return {"keytype": "SCHEMA", "subject": subject, "version": version, "magic": 1}


def config_key(subject: str | None) -> LogKey:
    return {"keytype": "CONFIG", "subject": subject, "magic": 0}


NOOP_KEY: LogKey = {"keytype": "NOOP", "magic": 0}


def candidate(schema: Any, schema_type: str | None = None, references: Any = None) -> Candidate:
    """Validate a schema given to the API (JSON text, as Confluent takes it) and normalise it."""
    if schema_type not in (None, "AVRO"):
        raise InvalidSchemaError(f"schema type {schema_type} is not supported: this registry serves AVRO only")
    if references:
        raise InvalidSchemaError("schema references are not supported: register a self-contained schema")
    if not isinstance(schema, str):
        raise InvalidSchemaError("'schema' must be the schema's JSON text (a string)")
    try:
        parsed = parse_avro(schema)
        document = json.loads(schema)
        canonical = to_parsing_canonical_form(document)
    except InvalidSchema as error:
        raise InvalidSchemaError(f"Invalid schema: {error}") from None
    except Exception as error:  # fastavro's canonical form rejects a few things parse accepts
        raise InvalidSchemaError(f"Invalid schema: {error}") from None
    return Candidate(json.dumps(document, separators=(",", ":")), canonical, parsed)


def version_number(version: str | int) -> int | None:
    """The version a URL names: a number in [1, 2^31-1], or None for ``latest`` (and ``-1``)."""
    text = str(version).strip()
    if text.lower() in ("latest", "-1"):
        return None
    try:
        number = int(text)
    except ValueError:
        number = 0
    if not 1 <= number <= MAX_VERSION:
        raise InvalidVersion(f"The specified version '{version}' is not a valid version id. Allowed values are "
                             f"between [1, {MAX_VERSION}] and the string \"latest\"")
    return number


class RegistryState:
    """Subjects, versions, schemas and levels, as the log has built them."""

    def __init__(self, ids: str = "fingerprint", default_level: str = "BACKWARD") -> None:
        if ids not in ID_STRATEGIES:
            raise ValueError(f"ids must be one of {', '.join(ID_STRATEGIES)}, got {ids!r}")
        self.ids = ids
        self.default_level = check_level(default_level)
        self._subjects: dict[str, dict[int, SchemaVersion]] = {}
        self._schemas: dict[int, str] = {}
        self._id_by_canonical: dict[str, int] = {}
        self._global_level: str | None = None
        self._subject_levels: dict[str, str] = {}

    # -- the log ------------------------------------------------------------------------------------------
    def apply(self, key: Mapping[str, Any] | None, value: Mapping[str, Any] | None) -> None:
        """Apply one log record; records of kinds this registry does not keep (NOOP, modes, ...) are skipped."""
        if not key:
            return
        kind = key.get("keytype")
        if kind == "SCHEMA":
            self._apply_schema(str(key["subject"]), int(key["version"]), value)
        elif kind == "CONFIG":
            self._apply_config(key.get("subject"), value)

    def _apply_schema(self, subject: str, version: int, value: Mapping[str, Any] | None) -> None:
        versions = self._subjects.setdefault(subject, {})
        if value is None:
            versions.pop(version, None)
            if not versions:
                del self._subjects[subject]
            return
        stored = SchemaVersion(subject, version, int(value["id"]), str(value["schema"]), bool(value.get("deleted")))
        versions[version] = stored
        if stored.id not in self._schemas:
            self._schemas[stored.id] = stored.schema
            try:
                self._id_by_canonical.setdefault(to_parsing_canonical_form(json.loads(stored.schema)), stored.id)
            except Exception:  # a record another tool wrote that we cannot parse stays servable by id
                pass

    def _apply_config(self, subject: Any, value: Mapping[str, Any] | None) -> None:
        level = None if value is None else value.get("compatibilityLevel")
        if subject is None:
            self._global_level = None if level is None else str(level)
        elif level is None:
            self._subject_levels.pop(str(subject), None)
        else:
            self._subject_levels[str(subject)] = str(level)

    # -- reads --------------------------------------------------------------------------------------------
    def schema(self, schema_id: int) -> str:
        try:
            return self._schemas[schema_id]
        except KeyError:
            raise SchemaNotFound(f"Schema {schema_id} not found") from None

    def subjects_of(self, schema_id: int) -> list[tuple[str, int]]:
        """Every (subject, version) holding the schema with this id."""
        self.schema(schema_id)
        return sorted((v.subject, v.version) for versions in self._subjects.values() for v in versions.values()
                      if v.id == schema_id and not v.deleted)

    def subjects(self, deleted: bool = False) -> list[str]:
        return sorted(name for name, versions in self._subjects.items()
                      if deleted or any(not v.deleted for v in versions.values()))

    def versions(self, subject: str, deleted: bool = False) -> list[SchemaVersion]:
        """A subject's versions, oldest first; SubjectNotFound when it has none."""
        found = [v for _, v in sorted(self._subjects.get(subject, {}).items()) if deleted or not v.deleted]
        if not found:
            raise SubjectNotFound(f"Subject '{subject}' not found.")
        return found

    def version(self, subject: str, version: str | int) -> SchemaVersion:
        number = version_number(version)
        versions = self.versions(subject)
        if number is None:
            return versions[-1]
        for stored in versions:
            if stored.version == number:
                return stored
        raise VersionNotFound(f"Version {number} not found.")

    def lookup(self, subject: str, schema: Candidate) -> SchemaVersion:
        """The subject's version holding this schema (the same canonical form)."""
        versions = self.versions(subject)
        schema_id = self._id_by_canonical.get(schema.canonical)
        for stored in versions:
            if stored.id == schema_id:
                return stored
        raise SchemaNotFound("Schema not found")

    def level(self, subject: str | None = None, fallback: bool = True) -> str:
        """The subject's compatibility level (else the global one); the global level when subject is None."""
        if subject is not None:
            if subject in self._subject_levels:
                return self._subject_levels[subject]
            if not fallback:
                raise SubjectLevelConfigNotFound(
                    f"Subject '{subject}' does not have subject-level compatibility configured")
        return self._global_level or self.default_level

    def compatibility(self, subject: str, schema: Candidate, version: str | int | None) -> Verdict:
        """Whether ``schema`` may follow the subject's versions: one version (``version``) or all (None), by level."""
        level = self.level(subject)
        if version is None:
            return check(schema.parsed, [parse_avro(v.schema) for v in self.versions(subject)], level)
        stored = self.version(subject, version)
        single = level.replace("_TRANSITIVE", "")
        return check(schema.parsed, [parse_avro(stored.schema)], single)

    # -- planning writes ----------------------------------------------------------------------------------
    def plan_register(self, subject: str, schema: Candidate, check_compatibility: bool = True,
                      ) -> tuple[SchemaVersion, bool]:
        """The version registering ``schema`` under ``subject`` makes, and True; (the existing one, False) when the
        subject holds it already.

        Raises IncompatibleSchemaVersion when the subject's level refuses it (unless
        ``check_compatibility`` is False: importing a product's own history) and
        InvalidSchemaError when a fingerprint id would name two schemas.
        """
        try:
            return self.lookup(subject, schema), False
        except (SubjectNotFound, SchemaNotFound):
            pass
        existing = [v for _, v in sorted(self._subjects.get(subject, {}).items())]
        live = [v for v in existing if not v.deleted]
        if check_compatibility and live:
            verdict = check(schema.parsed, [parse_avro(v.schema) for v in live], self.level(subject))
            if not verdict.compatible:
                raise IncompatibleSchemaVersion(
                    f"Schema being registered is incompatible with an earlier schema for subject \"{subject}\" "
                    f"({self.level(subject)}), details: " + "; ".join(verdict.problems))
        return SchemaVersion(subject, max((v.version for v in existing), default=0) + 1,
                             self._id_for(schema), schema.text), True

    def _id_for(self, schema: Candidate) -> int:
        known = self._id_by_canonical.get(schema.canonical)
        if known is not None:
            return known
        if self.ids == "sequential":
            return max(self._schemas, default=0) + 1
        schema_id = id_of_canonical_form(schema.canonical)
        if schema_id in self._schemas:
            raise InvalidSchemaError(f"schema id {schema_id} (its fingerprint) already names another schema")
        return schema_id

    @staticmethod
    def level_of(body: Mapping[str, Any]) -> str:
        """The level a ``PUT /config`` body names (``compatibility``, or ``compatibilityLevel``)."""
        level = body.get("compatibility", body.get("compatibilityLevel"))
        try:
            return check_level(level if isinstance(level, str) else "")
        except UnknownCompatibilityLevel as error:
            raise InvalidCompatibilityLevel(f"Invalid compatibility level. {error}") from None

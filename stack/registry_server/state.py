"""What a Schema Registry knows, rebuilt from its log: subjects, versions, schemas by id, compatibility levels.

The state changes only by :meth:`RegistryState.apply`, one log record at a time, so every
registry reading the same topic ends up with the same state. A write is planned against the
state (:meth:`RegistryState.plan_register`), appended to the log, and becomes visible when
the log record comes back and is applied.

Log records use the layout of Confluent's ``_schemas`` topic: JSON keys
``{"keytype": "SCHEMA", "subject", "version", "magic": 1}`` with values
``{"subject", "version", "id", "schema", "deleted"}`` (and ``metadata``, ``ruleSet`` when given;
``deleted`` true is a soft delete), ``{"keytype": "CONFIG", "subject", "magic": 0}`` with
``{"compatibilityLevel"}``, ``{"keytype": "MODE", "subject", "magic": 0}`` with ``{"mode"}``, and
``NOOP`` markers; a null value deletes (a SCHEMA one permanently). The schema text is kept as
first submitted; its canonical form decides ids.

Ids are either ``fingerprint`` (a schema's id is the content address agentstream's codec
writes, :func:`agentstream.schemas.schema_ids.id_of_canonical_form`, so producers need no round trip) or
``sequential`` (1, 2, 3, ... as Confluent assigns them). Either way one schema has one id
across all subjects, and schemas are the same when their Avro Parsing Canonical Forms are.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastavro.schema import to_parsing_canonical_form

from agentstream.infra.registry_client.errors import (
    IncompatibleSchemaVersion,
    InvalidCompatibilityLevel,
    InvalidMode,
    InvalidSchemaError,
    InvalidSubject,
    InvalidVersion,
    OperationNotPermitted,
    SchemaNotFound,
    SubjectLevelConfigNotFound,
    SubjectLevelModeNotFound,
    SubjectNotFound,
    SubjectNotSoftDeleted,
    SubjectSoftDeleted,
    VersionNotFound,
    VersionNotSoftDeleted,
    VersionSoftDeleted,
)
from agentstream.schemas.compatibility import (
    InvalidSchema,
    ParsedSchema,
    UnknownCompatibilityLevel,
    Verdict,
    check,
    check_level,
)
from agentstream.schemas.compatibility import parse as parse_avro
from agentstream.schemas.schema_ids import id_of_canonical_form

ID_STRATEGIES = ("fingerprint", "sequential")
MAX_VERSION = 2**31 - 1
MODES = ("READWRITE", "READONLY", "IMPORT")
GUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://agentstream.dev/schema-registry/guid")
LogKey = dict[str, Any]
LogValue = dict[str, Any] | None


@dataclass(frozen=True)
class StoredSchema:
    """One schema as first registered: its id, its text as submitted, the metadata and rule set it came with."""

    id: int
    text: str
    canonical: str | None = None  # None: a record another tool wrote that this registry cannot parse
    metadata: Mapping[str, Any] | None = None
    rule_set: Mapping[str, Any] | None = None

    @property
    def identity(self) -> str | None:
        return None if self.canonical is None else identity_of(self.canonical, self.metadata, self.rule_set)

    @property
    def guid(self) -> str:
        """A stable guid: derived from what makes the schema itself (the id, when it could not be parsed)."""
        return str(uuid.uuid5(GUID_NAMESPACE, self.identity if self.identity is not None else f"id:{self.id}"))

    def body(self) -> dict[str, Any]:
        """The JSON Confluent answers for a schema (AVRO, the default type, is not named)."""
        body: dict[str, Any] = {"schema": self.text, "guid": self.guid}
        if self.metadata is not None:
            body["metadata"] = self.metadata
        if self.rule_set is not None:
            body["ruleSet"] = self.rule_set
        return body


@dataclass(frozen=True)
class SchemaVersion:
    """One version of a subject."""

    subject: str
    version: int
    stored: StoredSchema
    deleted: bool = False

    @property
    def id(self) -> int:
        return self.stored.id

    @property
    def schema(self) -> str:
        return self.stored.text

    def body(self) -> dict[str, Any]:
        """The JSON Confluent answers for a version."""
        return {"subject": self.subject, "version": self.version, "id": self.id, **self.stored.body()}

    def log_value(self) -> LogValue:
        """The record this version is in the log (Confluent's ``SchemaValue`` layout)."""
        value: dict[str, Any] = {"subject": self.subject, "version": self.version, "id": self.id,
                                 "schema": self.schema, "deleted": self.deleted}
        if self.stored.metadata is not None:
            value["metadata"] = self.stored.metadata
        if self.stored.rule_set is not None:
            value["ruleSet"] = self.stored.rule_set
        return value


@dataclass(frozen=True)
class Candidate:
    """A schema checked for registration: its text as submitted, canonical form, parsed form, metadata and rules.

    ``identity`` is what makes two registrations the same schema (one id): the canonical form,
    plus the metadata and rule set when there are any, as Confluent counts them.
    """

    text: str
    canonical: str
    parsed: ParsedSchema
    metadata: Mapping[str, Any] | None = None
    rule_set: Mapping[str, Any] | None = None

    @property
    def identity(self) -> str:
        return identity_of(self.canonical, self.metadata, self.rule_set)


def identity_of(canonical: str, metadata: Mapping[str, Any] | None, rule_set: Mapping[str, Any] | None) -> str:
    """The canonical form alone for a plain schema (so its fingerprint id is the codec's), else with its extras."""
    if metadata is None and rule_set is None:
        return canonical
    return canonical + json.dumps({"metadata": metadata, "ruleSet": rule_set}, sort_keys=True, separators=(",", ":"))


def schema_key(subject: str, version: int) -> LogKey:
    return {"keytype": "SCHEMA", "subject": subject, "version": version, "magic": 1}


def config_key(subject: str | None) -> LogKey:
    return {"keytype": "CONFIG", "subject": subject, "magic": 0}


def mode_key(subject: str | None) -> LogKey:
    return {"keytype": "MODE", "subject": subject, "magic": 0}


NOOP_KEY: LogKey = {"keytype": "NOOP", "magic": 0}


def candidate(schema: Any, schema_type: str | None = None, references: Any = None, metadata: Any = None,
              rule_set: Any = None) -> Candidate:
    """Validate a schema given to the API (JSON text, as Confluent takes it); the text is kept as submitted."""
    if schema_type not in (None, "AVRO"):
        raise InvalidSchemaError(f"schema type {schema_type} is not supported: this registry serves AVRO only")
    if references:
        raise InvalidSchemaError("schema references are not supported: register a self-contained schema")
    if not isinstance(schema, str):
        raise InvalidSchemaError("'schema' must be the schema's JSON text (a string)")
    for name, extra in (("metadata", metadata), ("ruleSet", rule_set)):
        if extra is not None and not isinstance(extra, dict):
            raise InvalidSchemaError(f"'{name}' must be a JSON object")
    if metadata:
        check_metadata(metadata)
    if rule_set:
        check_rule_set(rule_set)
    try:
        parsed = parse_avro(schema)
        canonical = to_parsing_canonical_form(json.loads(schema))
    except InvalidSchema as error:
        raise InvalidSchemaError(f"Invalid schema: {error}") from None
    except Exception as error:  # fastavro's canonical form rejects a few things parse accepts
        raise InvalidSchemaError(f"Invalid schema: {error}") from None
    return Candidate(schema, canonical, parsed, metadata or None, rule_set or None)


RULE_KINDS = ("CONDITION", "TRANSFORM")
RULE_MODES = ("UPGRADE", "DOWNGRADE", "UPDOWN", "READ", "WRITE", "WRITEREAD")
RULE_LISTS = ("migrationRules", "domainRules", "encodingRules")


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _string_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(item, str) for item in value.values())


_METADATA_SHAPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tags": (lambda value: isinstance(value, dict) and all(map(_strings, value.values())),
             "an object of lists of strings"),
    "properties": (_string_map, "an object of strings"),
    "sensitive": (_strings, "a list of strings"),
}


def check_metadata(metadata: Mapping[str, Any]) -> None:
    """InvalidSchemaError unless ``metadata`` has Confluent's shape (tags: name -> [tag], properties: name -> text,
    sensitive: [name]): a stored shape the official client cannot parse would break every read of the version."""
    for name, (fits, shape) in _METADATA_SHAPES.items():
        if metadata.get(name) is not None and not fits(metadata[name]):
            raise InvalidSchemaError(f"metadata.{name} must be {shape}, got {json.dumps(metadata[name]):.80}")


def check_rule_set(rule_set: Mapping[str, Any]) -> None:
    """InvalidSchemaError unless each of ``rule_set``'s lists holds rules the official client can parse: objects
    whose ``kind`` and ``mode`` (when given) are Confluent's and whose ``params`` is an object of strings."""
    for name in RULE_LISTS:
        rules = rule_set.get(name)
        if rules is None:
            continue
        if not isinstance(rules, list) or not all(isinstance(rule, dict) for rule in rules):
            raise InvalidSchemaError(f"ruleSet.{name} must be a list of rule objects")
        for rule in rules:
            for field, allowed in (("kind", RULE_KINDS), ("mode", RULE_MODES)):
                if rule.get(field) is not None and rule[field] not in allowed:
                    raise InvalidSchemaError(f"ruleSet.{name}: rule {rule.get('name')!r} has {field} "
                                             f"{rule[field]!r}, expected one of {', '.join(allowed)}")
            if rule.get("params") is not None and not _string_map(rule["params"]):
                raise InvalidSchemaError(f"ruleSet.{name}: rule {rule.get('name')!r} has params that are not an "
                                         f"object of strings")


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


def check_subject(subject: str) -> str:
    """``subject`` when it may be written; InvalidSubject when it holds a control character (as Java's
    ``isISOControl``, Confluent's test): a newline or NUL would forge lines in logs and keys in the backing topic."""
    if any(ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F for char in subject):
        raise InvalidSubject(f"The specified subject {subject!r} is not valid: it holds a control character")
    return subject


def check_mode(mode: Any) -> str:
    """A mode a ``PUT /mode`` body names, upper-cased; InvalidMode for anything else."""
    name = mode.upper() if isinstance(mode, str) else ""
    if name not in MODES:
        raise InvalidMode(f"Invalid mode. Valid values are: {', '.join(MODES)}")
    return name


class RegistryState:
    """Subjects, versions, schemas, levels and modes, as the log has built them."""

    def __init__(self, ids: str = "fingerprint", default_level: str = "BACKWARD") -> None:
        if ids not in ID_STRATEGIES:
            raise ValueError(f"ids must be one of {', '.join(ID_STRATEGIES)}, got {ids!r}")
        self.ids = ids
        self.default_level = check_level(default_level)
        self._subjects: dict[str, dict[int, SchemaVersion]] = {}
        self._schemas: dict[int, StoredSchema] = {}
        self._id_by_identity: dict[str, int] = {}
        self._max_id = 0  # ids are never reused, even after a permanent delete
        self._global_level: str | None = None
        self._subject_levels: dict[str, str] = {}
        self._global_mode: str | None = None
        self._subject_modes: dict[str, str] = {}

    # -- the log ------------------------------------------------------------------------------------------
    def apply(self, key: Mapping[str, Any] | None, value: Mapping[str, Any] | None) -> None:
        """Apply one log record; records of kinds this registry does not keep (NOOP, ...) are skipped."""
        if not key:
            return
        kind = key.get("keytype")
        if kind == "SCHEMA":
            self._apply_schema(str(key["subject"]), int(key["version"]), value)
        elif kind == "CONFIG":
            self._apply_setting(self._subject_levels, "_global_level", key.get("subject"),
                                None if value is None else value.get("compatibilityLevel"))
        elif kind == "MODE":
            self._apply_setting(self._subject_modes, "_global_mode", key.get("subject"),
                                None if value is None else value.get("mode"))

    def _apply_schema(self, subject: str, version: int, value: Mapping[str, Any] | None) -> None:
        versions = self._subjects.setdefault(subject, {})
        if value is None:  # a permanent delete
            removed = versions.pop(version, None)
            if not versions:
                del self._subjects[subject]
            if removed is not None and not self._holders(removed.id):
                self._forget(removed.stored)
            return
        schema_id = int(value["id"])
        stored = self._schemas.get(schema_id)
        if stored is None:
            stored = self._remember(schema_id, str(value["schema"]), value.get("metadata"), value.get("ruleSet"))
        versions[version] = SchemaVersion(subject, version, stored, bool(value.get("deleted")))

    def _remember(self, schema_id: int, text: str, metadata: Any, rule_set: Any) -> StoredSchema:
        try:
            canonical: str | None = to_parsing_canonical_form(json.loads(text))
        except Exception:  # a record another tool wrote that we cannot parse stays servable by id
            canonical = None
        stored = StoredSchema(schema_id, text, canonical, metadata, rule_set)
        self._schemas[schema_id] = stored
        self._max_id = max(self._max_id, schema_id)
        if stored.identity is not None:
            self._id_by_identity.setdefault(stored.identity, schema_id)
        return stored

    def _forget(self, stored: StoredSchema) -> None:
        del self._schemas[stored.id]
        if stored.identity is not None and self._id_by_identity.get(stored.identity) == stored.id:
            del self._id_by_identity[stored.identity]

    def _holders(self, schema_id: int) -> list[SchemaVersion]:
        return [v for versions in self._subjects.values() for v in versions.values() if v.id == schema_id]

    def _apply_setting(self, by_subject: dict[str, str], global_attribute: str, subject: Any, setting: Any) -> None:
        if subject is None:
            setattr(self, global_attribute, None if setting is None else str(setting))
        elif setting is None:
            by_subject.pop(str(subject), None)
        else:
            by_subject[str(subject)] = str(setting)

    # -- reads --------------------------------------------------------------------------------------------
    def stored(self, schema_id: int) -> StoredSchema:
        try:
            return self._schemas[schema_id]
        except KeyError:
            raise SchemaNotFound(f"Schema {schema_id} not found") from None

    def schema(self, schema_id: int) -> str:
        return self.stored(schema_id).text

    def by_guid(self, guid: str) -> StoredSchema:
        for stored in self._schemas.values():
            if stored.guid == guid:
                return stored
        raise SchemaNotFound(f"Schema {guid} not found")

    def subjects_of(self, schema_id: int, deleted: bool = False) -> list[tuple[str, int]]:
        """Every (subject, version) holding the schema with this id (soft-deleted ones too with ``deleted``)."""
        self.stored(schema_id)
        return sorted((v.subject, v.version) for v in self._holders(schema_id) if deleted or not v.deleted)

    def subjects(self, deleted: bool = False, deleted_only: bool = False) -> list[str]:
        """Subjects with a live version; with ``deleted`` also soft-deleted ones; with ``deleted_only`` only those."""
        def live(name: str) -> bool:
            return any(not v.deleted for v in self._subjects[name].values())

        return sorted(name for name in self._subjects
                      if (not live(name) if deleted_only else deleted or live(name)))

    def versions(self, subject: str, deleted: bool = False) -> list[SchemaVersion]:
        """A subject's versions, oldest first (soft-deleted ones too with ``deleted``); SubjectNotFound when none."""
        found = [v for _, v in sorted(self._subjects.get(subject, {}).items()) if deleted or not v.deleted]
        if not found:
            raise SubjectNotFound(f"Subject '{subject}' not found.")
        return found

    def version(self, subject: str, version: str | int, deleted: bool = False) -> SchemaVersion:
        number = version_number(version)
        versions = self.versions(subject, deleted)
        if number is None:
            return versions[-1]
        for stored in versions:
            if stored.version == number:
                return stored
        raise VersionNotFound(f"Version {number} not found.")

    def lookup(self, subject: str, schema: Candidate, deleted: bool = False) -> SchemaVersion:
        """The subject's latest version holding this schema: the same canonical form, metadata and rules, or, for a
        schema sent without metadata and rules, the same canonical form (as Confluent looks them up)."""
        versions = self.versions(subject, deleted)
        schema_id = self._id_by_identity.get(schema.identity)
        for stored in reversed(versions):
            if stored.id == schema_id:
                return stored
        if schema.metadata is None and schema.rule_set is None:
            for stored in reversed(versions):
                if stored.stored.canonical == schema.canonical:
                    return stored
        raise SchemaNotFound("Schema not found")

    def latest_with_metadata(self, subject: str, properties: Mapping[str, str], deleted: bool = False
                             ) -> SchemaVersion:
        """The subject's latest version whose metadata properties hold every key and value of ``properties``."""
        for stored in reversed(self.versions(subject, deleted)):
            held = (stored.stored.metadata or {}).get("properties")
            if isinstance(held, dict) and all(held.get(key) == value for key, value in properties.items()):
                return stored
        raise SchemaNotFound(f"Schema with metadata {dict(properties)} not found under subject '{subject}'")

    def level(self, subject: str | None = None, fallback: bool = True) -> str:
        """The subject's compatibility level (else the global one); the global level when subject is None."""
        if subject is not None:
            if subject in self._subject_levels:
                return self._subject_levels[subject]
            if not fallback:
                raise SubjectLevelConfigNotFound(
                    f"Subject '{subject}' does not have subject-level compatibility configured")
        return self._global_level or self.default_level

    def mode(self, subject: str | None = None, fallback: bool = True) -> str:
        """The subject's mode (else the global one); the global mode (READWRITE by default) when subject is None."""
        if subject is not None:
            if subject in self._subject_modes:
                return self._subject_modes[subject]
            if not fallback:
                raise SubjectLevelModeNotFound(f"Subject '{subject}' does not have subject-level mode configured")
        return self._global_mode or "READWRITE"

    def compatibility(self, subject: str, schema: Candidate, version: str | int | None) -> Verdict:
        """Whether ``schema`` may follow the subject's versions: one version (``version``) or all (None), by level."""
        level = self.level(subject)
        if version is None:
            return check(schema.parsed, [parse_avro(v.schema) for v in self.versions(subject)], level)
        stored = self.version(subject, version)
        single = level.replace("_TRANSITIVE", "")
        return check(schema.parsed, [parse_avro(stored.schema)], single)

    # -- planning writes ----------------------------------------------------------------------------------
    def plan_register(self, subject: str, schema: Candidate, imported: tuple[int, int | None] | None = None,
                      product: bool = False) -> tuple[SchemaVersion, bool]:
        """The version registering ``schema`` under ``subject`` makes, and True; (the existing one, False) when the
        subject holds it already.

        ``imported`` is the (id, version) an IMPORT-mode registration gives. Raises
        OperationNotPermitted when the subject's mode refuses the write, IncompatibleSchemaVersion when
        its level refuses the schema and InvalidSchemaError
        when a fingerprint id would name two schemas. ``product`` (seeding agentstream's own schemas,
        whose ids records already carry) skips both the mode and the compatibility check.
        """
        mode = "READWRITE" if product else self._writable(subject)
        if imported is None and mode == "IMPORT":
            raise OperationNotPermitted(f"Subject {subject} is not in read-write mode: in IMPORT mode a "
                                        f"registration names the schema's id")
        if imported is not None:
            if mode != "IMPORT":
                raise OperationNotPermitted(f"Subject {subject} is not in import mode")
            return self._plan_import(subject, schema, *imported), True
        try:
            return self.lookup(subject, schema), False
        except (SubjectNotFound, SchemaNotFound):
            pass
        existing = [v for _, v in sorted(self._subjects.get(subject, {}).items())]
        live = [v for v in existing if not v.deleted]
        if live and not product:
            verdict = check(schema.parsed, [parse_avro(v.schema) for v in live], self.level(subject))
            if not verdict.compatible:
                raise IncompatibleSchemaVersion(
                    f"Schema being registered is incompatible with an earlier schema for subject \"{subject}\" "
                    f"({self.level(subject)}), details: " + "; ".join(verdict.problems))
        return SchemaVersion(subject, max((v.version for v in existing), default=0) + 1,
                             self._stored_for(schema)), True

    def _plan_import(self, subject: str, schema: Candidate, schema_id: int, version: int | None) -> SchemaVersion:
        known = self._schemas.get(schema_id)
        if known is not None and known.identity != schema.identity:
            raise OperationNotPermitted(f"Overwrite new schema with id {schema_id} is not permitted.")
        existing = self._subjects.get(subject, {})
        number = version if version is not None else max(existing, default=0) + 1
        if number in existing and existing[number].id != schema_id:
            raise OperationNotPermitted(f"Overwrite new schema in subject {subject} version {number} is not "
                                        f"permitted.")
        stored = known or StoredSchema(schema_id, schema.text, schema.canonical, schema.metadata, schema.rule_set)
        return SchemaVersion(subject, number, stored)

    def _stored_for(self, schema: Candidate) -> StoredSchema:
        known = self._id_by_identity.get(schema.identity)
        if known is not None:
            return self._schemas[known]
        if self.ids == "sequential":
            schema_id = self._max_id + 1
        else:
            schema_id = id_of_canonical_form(schema.identity)
            if schema_id in self._schemas:
                raise InvalidSchemaError(f"schema id {schema_id} (its fingerprint) already names another schema")
        return StoredSchema(schema_id, schema.text, schema.canonical, schema.metadata, schema.rule_set)

    def _writable(self, subject: str) -> str:
        """The subject's mode, when it allows writing its schemas; OperationNotPermitted when READONLY."""
        mode = self.mode(subject)
        if mode == "READONLY":
            raise OperationNotPermitted(f"Subject {subject} is in read-only mode")
        return mode

    def plan_delete_subject(self, subject: str, permanent: bool) -> list[SchemaVersion]:
        """The versions a delete of ``subject`` touches: every live one (soft), or every one (permanent, after a soft
        delete), with Confluent's errors (and in its order) otherwise."""
        every = self.versions(subject, deleted=True)
        live = [v for v in every if not v.deleted]
        if not permanent and not live:
            raise SubjectSoftDeleted(f"Subject '{subject}' was soft deleted.Set permanent=true to delete permanently")
        self._writable(subject)
        if permanent and live:
            raise SubjectNotSoftDeleted(f"Subject '{subject}' was not deleted first before being permanently deleted")
        return every if permanent else live

    def plan_delete_version(self, subject: str, version: str, permanent: bool) -> SchemaVersion:
        """The version a delete names (``latest``: the latest live one), with Confluent's errors (and in its
        order)."""
        number = version_number(version)
        every = self.versions(subject, deleted=True)
        if number is None:
            target = self.version(subject, "latest")
        else:
            found = [v for v in every if v.version == number]
            if not found:
                raise VersionNotFound(f"Version {number} not found.")
            target = found[0]
        if not permanent and target.deleted:
            raise VersionSoftDeleted(f"Subject '{subject}' Version {target.version} was soft deleted.Set "
                                     f"permanent=true to delete permanently")
        self._writable(subject)
        if permanent and not target.deleted:
            raise VersionNotSoftDeleted(f"Subject '{subject}' Version {target.version} was not deleted first before "
                                        f"being permanently deleted")
        return target

    def subject_settings(self, subject: str) -> tuple[bool, bool]:
        """Whether ``subject`` has its own (compatibility level, mode)."""
        return subject in self._subject_levels, subject in self._subject_modes

    def is_empty(self, subject: str | None = None) -> bool:
        """Whether no schema is registered (under ``subject``, else at all), soft-deleted ones counted."""
        return not (self._subjects.get(subject) if subject is not None else self._subjects)

    @staticmethod
    def level_of(body: Mapping[str, Any]) -> str:
        """The level a ``PUT /config`` body names (``compatibility``, or ``compatibilityLevel``); a body that asks
        for more than a level (metadata, rule sets, groups: not kept here) is refused."""
        extra = sorted(set(body) - {"compatibility", "compatibilityLevel"})
        if extra:
            raise OperationNotPermitted(f"this registry keeps only the compatibility level of a config; "
                                        f"{', '.join(extra)} is not supported")
        level = body.get("compatibility", body.get("compatibilityLevel"))
        try:
            return check_level(level if isinstance(level, str) else "")
        except UnknownCompatibilityLevel as error:
            raise InvalidCompatibilityLevel(f"Invalid compatibility level. {error}") from None

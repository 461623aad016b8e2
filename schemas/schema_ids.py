"""Content-addressed schema ids, and the registry interface that maps an id back to its writer schema."""

from __future__ import annotations

import hashlib
from typing import Protocol

from fastavro.schema import to_parsing_canonical_form

from .catalog import Schema, current_schemas, history_schemas
from .errors import SchemaIdCollision, UnknownSchemaId


def schema_id(schema: Schema) -> int:
    """Id of a self-contained schema: the first 31 bits of sha256 of its Parsing Canonical Form (0 becomes 1).

    Every process computes the same id for the same schema without asking anyone. Docs, defaults
    and logical types are not part of the canonical form, so they do not change the id.
    """
    return _fingerprint(schema)[0]


def id_of_canonical_form(canonical: str) -> int:
    """The id of the schema with this Parsing Canonical Form; the one definition of agentstream's schema ids."""
    digest = hashlib.sha256(canonical.encode("utf-8")).digest()
    return (int.from_bytes(digest[:4], "big") >> 1) or 1


def _fingerprint(schema: Schema) -> tuple[int, str]:
    canonical = to_parsing_canonical_form(schema)
    return id_of_canonical_form(canonical), canonical


class SchemaRegistry(Protocol):
    """Where writer schemas are kept by id; a Kafka-backed one may publish on register and fetch on lookup."""

    def register(self, schema: Schema) -> int:
        """Make `schema` (self-contained) resolvable by its id and return the id; raise SchemaIdCollision on a clash."""
        ...

    def lookup(self, schema_id: int) -> Schema:
        """The schema registered under `schema_id`; raise UnknownSchemaId when there is none."""
        ...


class BundledRegistry:
    """In-memory registry preloaded with every schema shipped in `schemas/avro/`, current and retired."""

    def __init__(self) -> None:
        self._schemas: dict[int, Schema] = {}
        self._canonical_forms: dict[int, str] = {}
        for schema in (*current_schemas().values(), *history_schemas()):
            self.register(schema)

    def register(self, schema: Schema) -> int:
        """Keep `schema` under its content-addressed id and return the id."""
        schema_id, canonical = _fingerprint(schema)
        known = self._canonical_forms.setdefault(schema_id, canonical)
        if known != canonical:
            raise SchemaIdCollision(f"schema id {schema_id} names two schemas:\n{known}\n{canonical}")
        self._schemas.setdefault(schema_id, schema)
        return schema_id

    def lookup(self, schema_id: int) -> Schema:
        """The schema with this id, or UnknownSchemaId."""
        try:
            return self._schemas[schema_id]
        except KeyError:
            raise UnknownSchemaId(schema_id) from None


_default: SchemaRegistry | None = None


def use_registry(registry: SchemaRegistry | None) -> None:
    """Make ``registry`` the one every codec and span encoder made without an explicit registry uses.

    agentstream's command line installs a client of the user's own Schema Registry here when
    ``[schema_registry] url`` is set, so records carry that registry's ids; None goes back to
    the bundled, content-addressed ids.
    """
    global _default
    _default = registry


def default_registry() -> SchemaRegistry:
    """The installed registry (:func:`use_registry`), else a new :class:`BundledRegistry`."""
    return _default if _default is not None else BundledRegistry()

"""Schema ids (the first 31 bits of the sha256 of the canonical form), pinned, and the registries that map ids
to schemas: the bundled one and any other that plugs into the codec."""

from __future__ import annotations

import copy
import hashlib

import avro.io
import avro.schema
import fastavro
import pytest
from fastavro.schema import to_parsing_canonical_form

from agentstream.schemas import (
    SPAN,
    TASK,
    AvroCodec,
    BundledRegistry,
    Schema,
    SchemaIdCollision,
    UnknownSchemaId,
    current_schemas,
    schema_id,
    self_contained,
)
from tests.support.avro_samples import (
    AVRO_DIR,
    PINNED_IDS,
    SAMPLES,
    llm_span,
    newer_span_schema,
    raw_schema,
)


def test_schema_id_is_first_31_bits_of_sha256_of_canonical_form() -> None:
    for schema in current_schemas().values():
        digest = hashlib.sha256(to_parsing_canonical_form(schema).encode()).digest()
        assert schema_id(schema) == int.from_bytes(digest[:4], "big") >> 1
        assert 0 < schema_id(schema) < 2**31


def test_current_ids_are_pinned() -> None:
    ids = {name: schema_id(schema) for name, schema in current_schemas().items()}
    assert ids == PINNED_IDS, "a schema changed: keep the old version in schemas/avro/history/, then re-pin"


def test_ids_ignore_docs_and_defaults_but_not_structure() -> None:
    span = raw_schema("span.avsc")
    documented = copy.deepcopy(span)
    documented["doc"] = "reworded"
    documented["fields"][3]["doc"] = "reworded too"
    assert schema_id(self_contained(documented)) == schema_id(self_contained(span))
    assert schema_id(self_contained(newer_span_schema())) != schema_id(self_contained(span))


@pytest.mark.parametrize("file_name", sorted(p.name for p in AVRO_DIR.glob("*.avsc")
                                             if not p.name.endswith("_batch.avsc")))
def test_canonical_form_agrees_with_apache_avro(file_name: str) -> None:
    ours = to_parsing_canonical_form(self_contained(raw_schema(file_name)))
    theirs = avro.schema.parse((AVRO_DIR / file_name).read_text()).canonical_form
    # Apache avro for Python (1.12) leaves a logical-typed primitive as {"type":"long"} where
    # the specification (and Java) write "long"; everything else must agree byte for byte.
    assert ours == theirs.replace('{"type":"long"}', '"long"')


def test_bundled_registry_knows_every_current_schema() -> None:
    registry = BundledRegistry()
    for name, schema in current_schemas().items():
        assert registry.lookup(PINNED_IDS[name]) is schema
    with pytest.raises(UnknownSchemaId):
        registry.lookup(1)


def test_register_is_idempotent_and_returns_the_content_address() -> None:
    registry = BundledRegistry()
    newer = self_contained(newer_span_schema())
    assert registry.register(newer) == registry.register(newer) == schema_id(newer)
    assert registry.lookup(schema_id(newer)) is newer


def test_two_schemas_with_one_id_are_a_collision() -> None:
    # Found by a birthday search: these two canonical forms share their first 31 sha256 bits.
    first = fastavro.parse_schema({"type": "enum", "name": "Collide", "symbols": ["s9105"]})
    second = fastavro.parse_schema({"type": "enum", "name": "Collide", "symbols": ["s86826"]})
    assert schema_id(first) == schema_id(second)
    registry = BundledRegistry()
    registry.register(first)
    with pytest.raises(SchemaIdCollision):
        registry.register(second)
    assert registry.lookup(schema_id(first)) is first


class CountingRegistry:
    """A registry that numbers schemas in arrival order, as a Confluent schema registry would."""

    def __init__(self) -> None:
        self.schemas: list[Schema] = []
        self.lookups = 0

    def register(self, schema: Schema) -> int:
        canonical = [to_parsing_canonical_form(known) for known in self.schemas]
        if to_parsing_canonical_form(schema) not in canonical:
            self.schemas.append(schema)
            return len(self.schemas)
        return canonical.index(to_parsing_canonical_form(schema)) + 1

    def lookup(self, schema_id: int) -> Schema:
        self.lookups += 1
        if not 0 < schema_id <= len(self.schemas):
            raise UnknownSchemaId(schema_id)
        return self.schemas[schema_id - 1]


def test_any_registry_plugs_in() -> None:
    registry = CountingRegistry()
    codec = AvroCodec(registry)
    task = codec.encode("Task", SAMPLES[TASK])
    span = codec.encode("Span", llm_span())
    assert task[:5] == b"\x00\x00\x00\x00\x01" and span[:5] == b"\x00\x00\x00\x00\x02"
    for _ in range(3):
        assert codec.decode(span) == (SPAN, llm_span())
    assert registry.lookups == 1  # the codec caches what it looked up
    assert codec.decode(span, reader_schema="Span") == (SPAN, llm_span())
    assert len(registry.schemas) == 2  # reading registers nothing
    with pytest.raises(UnknownSchemaId):
        codec.decode(b"\x00\x00\x00\x00\x09\x00")

"""The Avro compatibility checker agrees with the Apache Avro library's on reader/writer pairs, and names problems."""

from __future__ import annotations

import json

import avro.schema
import pytest
from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType

from agentstream.infra.registry_client.product import product_schemas
from agentstream.schemas.catalog import schema_json
from agentstream.schemas.compatibility import (
    InvalidSchema,
    UnknownCompatibilityLevel,
    can_read,
    check,
    check_level,
    parse,
)


def record(*fields: dict, name: str = "R") -> dict:
    return {"type": "record", "name": name, "namespace": "t", "fields": list(fields)}


def field(name: str, kind, **extra) -> dict:
    return {"name": name, "type": kind, **extra}


ENUM = {"type": "enum", "name": "E", "symbols": ["A", "B"]}
ENUM_MORE = {"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}
ENUM_DEFAULT = {"type": "enum", "name": "E", "symbols": ["A", "B"], "default": "A"}

# (reader, writer)
PAIRS = [
    ("int", "int"), ("long", "int"), ("double", "int"), ("int", "long"), ("float", "long"), ("double", "float"),
    ("string", "bytes"), ("bytes", "string"), ("string", "int"), ("boolean", "null"),
    (["null", "string"], "string"), ("string", ["null", "string"]), (["null", "long"], ["null", "int"]),
    (["null", "int"], ["null", "long"]), (["int", "string"], ["string", "int"]),
    ({"type": "array", "items": "long"}, {"type": "array", "items": "int"}),
    ({"type": "array", "items": "int"}, {"type": "array", "items": "long"}),
    ({"type": "map", "values": "string"}, {"type": "map", "values": "int"}),
    ({"type": "fixed", "name": "F", "size": 4}, {"type": "fixed", "name": "F", "size": 4}),
    ({"type": "fixed", "name": "F", "size": 4}, {"type": "fixed", "name": "F", "size": 8}),
    ({"type": "fixed", "name": "F", "size": 4}, {"type": "fixed", "name": "G", "size": 4}),
    (ENUM_MORE, ENUM), (ENUM, ENUM_MORE), (ENUM_DEFAULT, ENUM_MORE),
    (record(field("a", "int")), record(field("a", "int"), field("b", "string"))),
    (record(field("a", "int"), field("b", "string")), record(field("a", "int"))),
    (record(field("a", "int"), field("b", "string", default="x")), record(field("a", "int"))),
    (record(field("a", "long")), record(field("a", "int"))),
    (record(field("a", "int")), record(field("a", "long"))),
    (record(field("a", "int"), name="S"), record(field("a", "int"))),
    (record(field("c", "int", aliases=["a"])), record(field("a", "int"))),
    (record(field("x", {"type": "long", "logicalType": "timestamp-micros"})), record(field("x", "long"))),
    (record(field("next", ["null", "R"], default=None), field("v", "int")),
     record(field("next", ["null", "R"], default=None), field("v", "int"))),
    (record(field("e", ENUM_MORE), field("e2", "t.E")), record(field("e", ENUM), field("e2", "t.E"))),
]


def apache_verdict(reader, writer) -> bool:
    result = ReaderWriterCompatibilityChecker().get_compatibility(
        avro.schema.parse(json.dumps(reader)), avro.schema.parse(json.dumps(writer)))
    return result.compatibility is SchemaCompatibilityType.compatible


@pytest.mark.parametrize(("reader", "writer"), PAIRS, ids=[str(i) for i in range(len(PAIRS))])
def test_agrees_with_apache_avro(reader, writer) -> None:
    ours = can_read(parse(json.dumps(reader)), parse(json.dumps(writer)))
    assert ours.compatible == apache_verdict(reader, writer), ours.problems
    assert ours.compatible or all(problem.startswith("/") for problem in ours.problems)


def test_problems_name_the_field_and_the_reason() -> None:
    old = parse(json.dumps(record(field("a", "int"), field("kind", ENUM))))
    new = parse(json.dumps(record(field("a", "int"), field("kind", ENUM_MORE), field("b", "string"))))
    backward = check(new, [old], "BACKWARD")
    assert backward.problems == ["the new schema cannot read data written with the latest version: "
                                 "/fields/b: reader field is missing from the writer and has no default"]
    forward = check(new, [old], "FORWARD")
    assert len(forward.problems) == 1 and "/fields/kind/type/symbols" in forward.problems[0]
    assert "['C']" in forward.problems[0]
    assert len(check(new, [old], "FULL").problems) == 2
    assert check(new, [old], "NONE").compatible


def test_transitive_levels_check_every_earlier_version() -> None:
    v1 = parse(json.dumps(record(field("a", "int"))))
    v2 = parse(json.dumps(record(field("a", "int"), field("b", "string", default=""))))
    v3 = parse(json.dumps(record(field("b", "string", default=""))))  # drops a: v1 data lacks b (default)...
    v3_strict = parse(json.dumps(record(field("b", "string"))))
    assert check(v3, [v1, v2], "BACKWARD_TRANSITIVE").compatible
    assert check(v3_strict, [v2], "BACKWARD").compatible
    transitive = check(v3_strict, [v1, v2], "BACKWARD_TRANSITIVE")
    assert not transitive.compatible and "/fields/b" in transitive.problems[0]


def test_product_schemas_follow_their_history() -> None:
    by_subject: dict[str, list] = {}
    for subject, schema in product_schemas():
        by_subject.setdefault(subject, []).append(parse(schema_json(schema)))
    for subject, versions in by_subject.items():
        assert check(versions[-1], versions[:-1], "BACKWARD_TRANSITIVE").compatible, subject


def test_bad_input_is_named() -> None:
    with pytest.raises(InvalidSchema):
        parse("{not json")
    with pytest.raises(InvalidSchema):
        parse(json.dumps({"type": "record", "name": "R", "fields": [{"name": "a", "type": "nope"}]}))
    with pytest.raises(UnknownCompatibilityLevel):
        check_level("SIDEWAYS")
    assert check_level("full_transitive") == "FULL_TRANSITIVE"

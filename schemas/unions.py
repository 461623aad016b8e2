"""Name the branch of nullable array and map fields up front, so fastavro skips validating every item to pick it.

fastavro picks a union branch by validating the value against each branch in turn; for a
`["null", {"type": "array", ...}]` field that is a full pass over the array before it is
written, which doubles the cost of encoding a span with token ids. Its tuple notation,
`("array", value)`, names the branch instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

BranchTagger = Callable[[Any], Any]


def branch_tagger(schema: Any) -> BranchTagger | None:
    """A function that rewrites a value of `schema` into tuple notation where it helps; None when it never does."""
    if isinstance(schema, list):
        return _nullable_container_tagger(schema)
    if not isinstance(schema, dict):
        return None  # a primitive, or a named type defined earlier in the schema
    kind = schema["type"]
    if kind == "record":
        return _record_tagger(schema)
    if kind == "array":
        tag_item = branch_tagger(schema["items"])
        return None if tag_item is None else (lambda items: [tag_item(item) for item in items])
    if kind == "map":
        tag_value = branch_tagger(schema["values"])
        return None if tag_value is None else (lambda values: {key: tag_value(v) for key, v in values.items()})
    return None


def _nullable_container_tagger(union: list[Any]) -> BranchTagger | None:
    if len(union) != 2 or "null" not in union:
        return None
    branch = union[1] if union[0] == "null" else union[0]
    if not isinstance(branch, dict) or branch["type"] not in ("array", "map"):
        return None
    branch_name = branch["type"]
    tag_inside = branch_tagger(branch) or (lambda value: value)
    return lambda value: None if value is None else (branch_name, tag_inside(value))


def _record_tagger(schema: dict[str, Any]) -> BranchTagger | None:
    field_taggers = [
        (field["name"], tagger) for field in schema["fields"] if (tagger := branch_tagger(field["type"])) is not None
    ]
    if not field_taggers:
        return None

    def tag_record(record: Any) -> Any:
        tagged = dict(record)
        for name, tagger in field_taggers:
            if name in tagged:
                tagged[name] = tagger(tagged[name])
        return tagged

    return tag_record

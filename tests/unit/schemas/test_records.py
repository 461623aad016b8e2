"""The typed records of schemas/records.py: the same fields, required keys and value types as their Avro schemas."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_type_hints

import pytest

from agentstream.schemas import ROLLOUT_EVENT, SPAN, TASK, AvroCodec, current_schemas
from agentstream.schemas.records import RolloutEventRecord, SpanRecord, TaskRecord
from agentstream.schemas.span_writer import SpanBatchEncoder

PRIMITIVES: dict[str, type] = {"string": str, "int": int, "long": int, "float": float, "double": float,
                               "boolean": bool}


def python_type(avro: Any) -> Any:
    """The value type a producer passes for an Avro type (enums as their symbol, arrays as lists)."""
    if isinstance(avro, list):
        assert len(avro) == 2 and avro[0] == "null", f"only nullable unions are translated, not {avro}"
        return python_type(avro[1]) | None
    if isinstance(avro, dict):
        kind = avro["type"]
        if kind == "enum":
            return str
        if kind == "map":
            return Mapping[str, python_type(avro["values"])]
        if kind == "array":
            return list[python_type(avro["items"])]
        return python_type(kind)  # a primitive with a logical type (timestamp-micros)
    return PRIMITIVES[avro]


@pytest.mark.parametrize(("record", "name"),
                         [(SpanRecord, SPAN), (RolloutEventRecord, ROLLOUT_EVENT), (TaskRecord, TASK)])
def test_a_typed_record_has_its_schemas_fields_in_order_with_the_same_types(record: Any, name: str):
    fields = current_schemas()[name]["fields"]
    assert list(record.__annotations__) == [field["name"] for field in fields]
    assert record.__required_keys__ == {field["name"] for field in fields if "default" not in field}
    hints = get_type_hints(record)
    assert {field["name"]: hints[field["name"]] for field in fields} == \
        {field["name"]: python_type(field["type"]) for field in fields}


def test_a_typed_record_is_the_plain_dict_the_writers_take():
    span: SpanRecord = {"span_id": "s", "rollout_id": "r", "attempt_id": "a", "name": "chat m", "kind": "LLM",
                        "start_time_us": 1, "end_time_us": 2, "prompt_token_ids": [1, 2], "response_token_ids": [3],
                        "response_logprobs": [-0.5]}
    assert type(span) is dict
    codec = AvroCodec()
    decoded = codec.decode(SpanBatchEncoder().encode_span(span), SPAN)[1]
    assert {key: decoded[key] for key in span} == span
    event: RolloutEventRecord = {"rollout_id": "r", "attempt_id": "a", "event": "STARTED", "at_us": 1}
    assert codec.decode(codec.encode(ROLLOUT_EVENT, event))[1] == {**event, "worker_id": None, "error": None,
                                                                   "task_id": None, "agent_name": None}

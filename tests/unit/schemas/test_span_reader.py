"""The span reader and transition drafts: what fastavro reads, without decoding token arrays, and back to Avro;
the train flag found in the attributes map. Every reader test runs on the compiled reader and on its Python
reference."""

from __future__ import annotations

import io
import random

import fastavro
import pytest

from agentstream.schemas import TRANSITION, AvroCodec, current_schemas
from agentstream.schemas.contracts import TRAIN_ATTRIBUTE
from agentstream.schemas.span_reader import MalformedSpan, ReferenceSpanReader, SpanReader
from agentstream.schemas.transition_writer import ONE_CALL, draft
from agentstream.streams.trajectory import SpanNode
from tests.support.spans import random_span

CODEC = AvroCodec()
READERS = pytest.mark.parametrize("reader_class", [SpanReader, ReferenceSpanReader], ids=["compiled", "reference"])


@READERS
def test_reader_agrees_with_fastavro_and_keeps_token_arrays_as_transition_bytes(reader_class):
    rng = random.Random(11)
    spans = [random_span(rng, i) for i in range(60)]
    record = CODEC.encode_span_batch(spans)
    _, _, schema = CODEC.writer_schema(record)
    nodes = reader_class(schema, SpanNode).batch(record[5:])
    assert len(nodes) == len(spans)
    transition_schema = current_schemas()[TRANSITION]
    for node, span in zip(nodes, spans, strict=True):
        assert (node.span_id, node.attempt_id, node.kind, node.name, node.status) == (
            span["span_id"], span["attempt_id"], span["kind"], span["name"], span["status"])
        assert (node.start_us, node.end_us, node.policy_version, node.reward) == (
            span["start_time_us"], span["end_time_us"], span["policy_version"], span["reward"])
        assert (node.parent_id, node.agent_name, node.group_id) == (
            span["parent_id"] or "", span["agent_name"] or "", span["group_id"] or "")
        assert node.reward_dimensions == (span["reward_dimensions"] or {})
        trainable = bool(span.get("prompt_token_ids")) and bool(span.get("response_token_ids"))
        assert node.has_token_ids == trainable
        if not trainable:
            assert node.tokens == b""
            continue
        datum = draft("r", node.attempt_id, "agent", "m", 3, node).complete(0.5, 0.25, -1.5, None, 7)
        value = fastavro.schemaless_reader(io.BytesIO(datum), transition_schema)
        assert value["prompt_token_ids"] == span["prompt_token_ids"]
        assert value["response_token_ids"] == span["response_token_ids"]
        assert value["behaviour_logprobs"] == pytest.approx(span["response_logprobs"], abs=1e-6)
        assert (value["step_index"], value["reward"], value["return_value"], value["advantage"]) == (3, 0.5, 0.25, -1.5)
        assert value["group_id"] is None and value["policy_version"] == (span["policy_version"] or 0)


@READERS
def test_reader_skips_blocks_written_with_byte_sizes(reader_class):
    """Avro writers may write a negative block count followed by the block's size; the reader honours both forms."""
    schema = {"type": "record", "name": "row", "fields": [
        {"name": "span_id", "type": "string"}, {"name": "attempt_id", "type": "string"},
        {"name": "name", "type": "string"}, {"name": "kind", "type": "string"},
        {"name": "start_time_us", "type": "long"}, {"name": "end_time_us", "type": "long"},
        {"name": "prompt_token_ids", "type": {"type": "array", "items": "int"}},
        {"name": "response_token_ids", "type": {"type": "array", "items": "int"}},
        {"name": "response_logprobs", "type": {"type": "array", "items": "float"}}]}
    sized_ids = b"\x05\x06\x02\x04\x06" + b"\x02\x80\x01" + b"\x00"  # a block of 3 items in 3 bytes, then 1 item
    row = b"\x04s1\x04a1\x02n\x06LLM\x02\x04" + sized_ids + b"\x02\x0e\x00" + b"\x02\x00\x00\x80\xbf\x00"
    [node] = reader_class(fastavro.parse_schema(schema), SpanNode).rows(1, row)
    assert node.has_token_ids and node.tokens.startswith(sized_ids)
    datum = b"\x02x" * 5 + b"\x00\x00" + node.tokens + ONE_CALL + b"\x00" * 24 + b"\x00\x00"
    value = fastavro.schemaless_reader(io.BytesIO(datum), current_schemas()[TRANSITION])
    assert value["prompt_token_ids"] == [1, 2, 3, 64] and value["response_token_ids"] == [7]
    assert value["behaviour_logprobs"] == [-1.0]


@pytest.mark.parametrize("cut", [1, 7, 40, 300])
@READERS
def test_cut_short_or_corrupt_batches_raise_malformed_span(cut, reader_class):
    record = CODEC.encode_span_batch([random_span(random.Random(cut), i) for i in range(4)])
    _, _, schema = CODEC.writer_schema(record)
    with pytest.raises(MalformedSpan):
        reader_class(schema, SpanNode).batch(record[5:-cut])
    with pytest.raises(MalformedSpan):
        reader_class(schema, SpanNode).batch(record[5:] + b"\x00")


@READERS
def test_a_negative_string_length_is_malformed(reader_class):
    record = CODEC.encode_span_batch([random_span(random.Random(3), 0)])
    _, _, schema = CODEC.writer_schema(record)
    body = bytearray(record[5:])
    assert body[0] == 2 and body[1] == 2 * len("s0"), "a batch of one span, then the span_id's length"
    body[1] = 3  # the zigzag varint of -2
    with pytest.raises(MalformedSpan, match="negative string length -2"):
        reader_class(schema, SpanNode).batch(bytes(body))


def span(index: int, attributes: dict[str, str]) -> dict:
    return {"span_id": f"s{index}", "rollout_id": "r", "attempt_id": "a", "name": "chat", "kind": "LLM",
            "start_time_us": index, "end_time_us": index + 1, "status": "OK", "attributes": attributes,
            "model": "m", "prompt_token_ids": [1, 2], "response_token_ids": [3], "response_logprobs": [-0.5]}


def read(attributes_list: list[dict[str, str]], reader_class) -> list[SpanNode]:
    record = CODEC.encode_span_batch([span(i, a) for i, a in enumerate(attributes_list)])
    _, _, schema = CODEC.writer_schema(record)
    return reader_class(schema, SpanNode).batch(record[5:])


SAME_LENGTH = "agentstream.trail"  # as long as agentstream.train, one byte apart
assert len(SAME_LENGTH) == len(TRAIN_ATTRIBUTE)


@pytest.mark.parametrize("attributes, expected", [
    ({TRAIN_ATTRIBUTE: "true"}, True),
    ({TRAIN_ATTRIBUTE: "false"}, False),
    ({TRAIN_ATTRIBUTE: "FALSE"}, False),
    ({TRAIN_ATTRIBUTE: "1"}, True),
    ({}, None),
    ({"gen_ai.system": "agentstream", "k": "v" * 300}, None),
    ({TRAIN_ATTRIBUTE: "maybe"}, None),
    ({TRAIN_ATTRIBUTE: ""}, None),
    ({SAME_LENGTH: "false", "Agentstream.train": "false", "agentstream.trains": "false"}, None),
    ({"gen_ai.system": "x", SAME_LENGTH: "true", TRAIN_ATTRIBUTE: "false", "z" * 200: "y" * 200}, False),
    ({"a" * 17: "true", TRAIN_ATTRIBUTE: "yes", "b" * 17: "no"}, True),
])
@READERS
def test_reader_picks_the_train_flag_from_the_attributes_map(attributes, expected, reader_class):
    [node] = read([attributes], reader_class)
    assert node.train is expected
    assert node.span_id == "s0" and node.has_token_ids and node.model == "m", "the fields after the map still read"


@READERS
def test_reader_flags_differ_per_span_and_the_rest_of_the_batch_reads_on(reader_class):
    nodes = read([{TRAIN_ATTRIBUTE: "true"}, {}, {TRAIN_ATTRIBUTE: "false", "x": "y"}, {SAME_LENGTH: "true"}],
                 reader_class)
    assert [n.train for n in nodes] == [True, None, False, None]
    assert [n.span_id for n in nodes] == ["s0", "s1", "s2", "s3"]


@READERS
def test_a_flag_value_that_is_not_text_never_raises(reader_class):
    record = bytearray(CODEC.encode_span_batch([span(0, {TRAIN_ATTRIBUTE: "XXXX", "other": "YYYY"})]))
    for marker in (b"XXXX", b"YYYY"):
        at = record.index(marker)
        record[at:at + 4] = b"\xff\xfe\x00\x80"  # not UTF-8: nothing in the map is decoded
    _, _, schema = CODEC.writer_schema(bytes(record))
    [node] = reader_class(schema, SpanNode).batch(bytes(record[5:]))
    assert node.train is None and node.span_id == "s0"


@READERS
def test_reader_finds_the_flag_in_blocks_written_with_byte_sizes(reader_class):
    schema = fastavro.parse_schema({"type": "record", "name": "row", "fields": [
        {"name": "span_id", "type": "string"}, {"name": "attempt_id", "type": "string"},
        {"name": "name", "type": "string"}, {"name": "kind", "type": "string"},
        {"name": "start_time_us", "type": "long"}, {"name": "end_time_us", "type": "long"},
        {"name": "attributes", "type": {"type": "map", "values": "string"}}]})

    def entry(key: str, value: str) -> bytes:
        return bytes([2 * len(key)]) + key.encode() + bytes([2 * len(value)]) + value.encode()

    block = entry("gen_ai.system", "x") + entry(TRAIN_ATTRIBUTE, "false")
    sized = bytes([3]) + bytes([2 * len(block)]) + block + b"\x02" + entry("k", "v") + b"\x00"  # -2 items, then 1
    row = b"\x04s1\x04a1\x02n\x06LLM\x02\x04" + sized
    [node] = reader_class(schema, SpanNode).rows(1, row)
    assert node.train is False and node.span_id == "s1"


@READERS
def test_a_schema_without_attributes_reads_no_flag(reader_class):
    schema = fastavro.parse_schema({"type": "record", "name": "row", "fields": [
        {"name": "span_id", "type": "string"}, {"name": "attempt_id", "type": "string"},
        {"name": "name", "type": "string"}, {"name": "kind", "type": "string"},
        {"name": "start_time_us", "type": "long"}, {"name": "end_time_us", "type": "long"}]})
    [node] = reader_class(schema, SpanNode).rows(1, b"\x04s1\x04a1\x02n\x06LLM\x02\x04")
    assert node.train is None

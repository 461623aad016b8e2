"""The span reader and transition drafts: what fastavro reads, without decoding token arrays, and back to Avro."""

from __future__ import annotations

import asyncio
import io
import random

import fastavro
import pytest

from infra.config import load_config
from schemas import TRANSITION, TRANSITION_BATCH, AvroCodec, current_schemas
from schemas.container_file import read_container
from schemas.span_reader import MalformedSpan, SpanReader
from schemas.transition_writer import ONE_CALL, RECORD_BYTES, batch_records, draft, transitions_container
from streams.stage import Stage, Transitions
from streams.trajectory import SpanNode

CODEC = AvroCodec()


def random_span(rng: random.Random, index: int) -> dict:
    llm = index % 3 != 2
    span = {"span_id": f"s{index}", "rollout_id": "r", "attempt_id": rng.choice(["a1", "a2"]), "name": "chat é",
            "kind": "LLM" if llm else "REWARD", "start_time_us": rng.randrange(1 << 52),
            "end_time_us": rng.randrange(1 << 52), "status": rng.choice(["OK", "ERROR", "UNSET"]),
            "attributes": {f"k{i}": "v" * rng.randrange(200) for i in range(rng.randrange(4))},
            "parent_id": rng.choice([None, "root"]), "agent_name": rng.choice([None, "agent"]),
            "group_id": rng.choice([None, "g"]), "model": "m" if llm else None,
            "policy_version": rng.choice([None, rng.randrange(1 << 40)]),
            "reward": None if llm else rng.uniform(-1, 1),
            "reward_dimensions": None if llm else {"format": 0.5}}
    if llm:
        size = rng.choice([0, 1, 63, 64, 300])  # counts around the one-byte varint limit
        span["prompt_token_ids"] = [rng.randrange(-(1 << 31), 1 << 31) for _ in range(size)]
        span["response_token_ids"] = [rng.randrange(1 << 17) for _ in range(rng.randrange(1, 80))]
        span["response_logprobs"] = [-rng.random() for _ in span["response_token_ids"]]
    return span


def test_reader_agrees_with_fastavro_and_keeps_token_arrays_as_transition_bytes():
    rng = random.Random(11)
    spans = [random_span(rng, i) for i in range(60)]
    record = CODEC.encode_span_batch(spans)
    _, _, schema = CODEC.writer_schema(record)
    nodes = SpanReader(schema, SpanNode).batch(record[5:])
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


def test_reader_skips_blocks_written_with_byte_sizes():
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
    [node] = SpanReader(fastavro.parse_schema(schema), SpanNode).rows(1, row)
    assert node.has_token_ids and node.tokens.startswith(sized_ids)
    datum = b"\x02x" * 5 + b"\x00\x00" + node.tokens + ONE_CALL + b"\x00" * 24 + b"\x00\x00"
    value = fastavro.schemaless_reader(io.BytesIO(datum), current_schemas()[TRANSITION])
    assert value["prompt_token_ids"] == [1, 2, 3, 64] and value["response_token_ids"] == [7]
    assert value["behaviour_logprobs"] == [-1.0]


@pytest.mark.parametrize("cut", [1, 7, 40, 300])
def test_cut_short_or_corrupt_batches_raise_malformed_span(cut):
    record = CODEC.encode_span_batch([random_span(random.Random(cut), i) for i in range(4)])
    _, _, schema = CODEC.writer_schema(record)
    with pytest.raises(MalformedSpan):
        SpanReader(schema, SpanNode).batch(record[5:-cut])
    with pytest.raises(MalformedSpan):
        SpanReader(schema, SpanNode).batch(record[5:] + b"\x00")


def test_a_negative_string_length_is_malformed():
    record = CODEC.encode_span_batch([random_span(random.Random(3), 0)])
    _, _, schema = CODEC.writer_schema(record)
    body = bytearray(record[5:])
    assert body[0] == 2 and body[1] == 2 * len("s0"), "a batch of one span, then the span_id's length"
    body[1] = 3  # the zigzag varint of -2
    with pytest.raises(MalformedSpan, match="negative string length -2"):
        SpanReader(schema, SpanNode).batch(bytes(body))


def test_transition_records_are_bounded_and_the_container_reads_back():
    rng = random.Random(5)
    span = random_span(rng, 0) | {"prompt_token_ids": list(range(3000)), "response_token_ids": [1, 2]}
    record = CODEC.encode_span_batch([span])
    _, _, schema = CODEC.writer_schema(record)
    [node] = SpanReader(schema, SpanNode).batch(record[5:])
    datums = [draft(f"r{i}", "a1", "agent", "m", 0, node).complete(1.0, 1.0, 1.0, "g", i) for i in range(200)]
    records = list(batch_records(CODEC, datums))
    assert sum(count for count, _ in records) == 200 and len(records) > 1
    assert all(len(value) <= RECORD_BYTES + len(datums[0]) + 16 for _, value in records)
    decoded = [t for _, value in records for t in CODEC.decode(value)[1]["transitions"]]
    assert CODEC.decode(records[0][1])[0] == TRANSITION_BATCH
    assert [t["rollout_id"] for t in decoded] == [f"r{i}" for i in range(200)]
    assert decoded[7]["prompt_token_ids"] == list(range(3000)) and decoded[7]["group_id"] == "g"
    schema, blocks = read_container(transitions_container(datums))
    assert schema["name"].endswith("Transition") and sum(count for count, _ in blocks) == 200


def test_transitions_are_published_by_model_with_the_rollouts_they_carry():
    class Emitter:
        def __init__(self) -> None:
            self.sent: list[tuple[str, bytes | None, bytes, list[tuple[str, bytes]] | None]] = []
            self.flushed = 0

        async def send(self, topic, key, value, headers=None) -> None:
            self.sent.append((topic, key, value, headers))

        async def flush(self) -> None:
            self.flushed += 1

    record = CODEC.encode_span_batch([random_span(random.Random(6), 0)])
    _, _, schema = CODEC.writer_schema(record)
    [node] = SpanReader(schema, SpanNode).batch(record[5:])
    transitions = Transitions()
    for rollout, model in [("r2", "m-b"), ("r1", "m-a"), ("r3", "m-b"), ("r2", "m-b")]:
        pending = draft(rollout, "a1", "agent", model, 0, node)
        transitions.drafts.append(pending)
        transitions.datums.append(pending.complete(1.0, 1.0, 0.5, None, 7))
    emitter = Emitter()
    # publishing needs neither a holder nor a sink
    stage = Stage(load_config(environ={}), emitter, holder=None, sink=None, codec=CODEC)  # type: ignore[arg-type]
    asyncio.run(stage.publish_transitions(transitions))
    asyncio.run(stage.publish_transitions(Transitions()))  # nothing to send: no record, no flush
    assert [(key, headers) for _, key, _, headers in emitter.sent] == [
        (b"m-a", [("agentstream-rollouts", b"r1")]), (b"m-b", [("agentstream-rollouts", b"r2,r3")])]
    assert {topic for topic, _, _, _ in emitter.sent} == {stage.transitions_topic}
    assert [[t["rollout_id"] for t in CODEC.decode(value)[1]["transitions"]] for _, _, value, _ in emitter.sent] == [
        ["r1"], ["r2", "r3", "r2"]]
    assert emitter.flushed == 1 and stage.counters.transitions == 4


def test_transitions_refuse_a_transition_schema_they_do_not_write(monkeypatch):
    """draft() writes the Transition fields by hand: a changed schema must stop it, not produce garbage."""
    from schemas import EncodeError
    from schemas import transition_writer as transitions

    transitions.check_layout.cache_clear()
    transitions.check_layout()  # the bundled schema is the layout written
    monkeypatch.setattr(transitions, "TRANSITION_SCHEMA_ID", transitions.TRANSITION_SCHEMA_ID + 1)
    transitions.check_layout.cache_clear()
    try:
        with pytest.raises(EncodeError, match=r"update schemas\.transition_writer"):
            transitions.transitions_container([])
    finally:
        transitions.check_layout.cache_clear()


def test_the_streams_worker_keeps_its_state_under_the_stack_home(tmp_path, monkeypatch):
    from infra.config import load_config
    from streams.app import create_app

    monkeypatch.chdir(tmp_path)
    config = load_config(environ={"AGENTSTREAM_HOME": str(tmp_path / "home")})
    app = create_app(config, "127.0.0.1:1", "http://127.0.0.1:2")
    assert app.conf.datadir.is_relative_to(tmp_path / "home"), "not faust's default, the current directory"

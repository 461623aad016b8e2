"""The transition writer: records bounded in size, the container file, and a refusal of a schema it does not write."""

from __future__ import annotations

import random

import pytest

from agentstream.schemas import TRANSITION_BATCH, AvroCodec
from agentstream.schemas.container_file import read_container
from agentstream.schemas.span_reader import SpanReader
from agentstream.schemas.transition_writer import RECORD_BYTES, batch_records, draft, transitions_container
from agentstream.streams.trajectory import SpanNode
from tests.support.spans import random_span

CODEC = AvroCodec()


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


def test_transitions_refuse_a_transition_schema_they_do_not_write(monkeypatch):
    """draft() writes the Transition fields by hand: a changed schema must stop it, not produce garbage."""
    from agentstream.schemas import EncodeError
    from agentstream.schemas import transition_writer as transitions

    transitions.check_layout.cache_clear()
    transitions.check_layout()  # the bundled schema is the layout written
    monkeypatch.setattr(transitions, "TRANSITION_SCHEMA_ID", transitions.TRANSITION_SCHEMA_ID + 1)
    transitions.check_layout.cache_clear()
    try:
        with pytest.raises(EncodeError, match=r"update agentstream\.schemas\.transition_writer"):
            transitions.transitions_container([])
    finally:
        transitions.check_layout.cache_clear()

"""Poison records on a consumed topic end as dead letters or skips with a reason: never an exception, never a hang."""

from __future__ import annotations

import threading

import fastavro
import pytest

from agentstream.infra.config import load_config
from agentstream.schemas import SPAN, AvroCodec, NotWireFormat, history_schemas, span_reader
from agentstream.schemas.binary import write_long
from agentstream.schemas.span_reader import MalformedSpan, compile_reader
from agentstream.streams.groups import GroupProcessor
from agentstream.streams.records import RawRecord, sort_records

IDS = fastavro.parse_schema({"type": "record", "name": "Ids", "fields": [
    {"name": "ids", "type": {"type": "array", "items": "int"}},
    {"name": "tags", "type": {"type": "map", "values": "string"}}]})


def read_within(reader, body: bytes, seconds: float = 5.0):
    """Run a reader in a thread; fail (rather than hang the suite) if it does not finish in time."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = reader(body, 0)
        except Exception as error:  # the test inspects it
            outcome["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"the reader did not finish within {seconds} s on {body[:16]!r}"
    return outcome


def test_a_tombstone_is_a_dead_letter_not_a_crash():
    tombstone = RawRecord("agentstream.spans", 0, 7, b"rollout-1", None)  # type: ignore[arg-type]
    out = sort_records([tombstone], AvroCodec())
    assert [record for record, _ in out.dead] == [tombstone]
    (_, error), = out.dead
    assert isinstance(error, NotWireFormat) and "tombstone" in str(error)


def test_a_tombstone_read_by_any_consumer_is_not_wire_format():
    with pytest.raises(NotWireFormat, match="tombstone"):
        AvroCodec().decode(None, "Task")  # type: ignore[arg-type]  # a Kafka record without a value


def test_the_groups_topic_reads_the_current_rollout_result_and_skips_other_records(caplog):
    codec = AvroCodec()
    result = {"rollout_id": "r", "attempt_id": "a", "group_id": "g", "agent_name": "agent", "status": "SUCCEEDED",
              "final_reward": 1.0, "completed_at_us": 1}
    span = {"span_id": "s", "rollout_id": "r", "attempt_id": "a", "name": "chat", "kind": "LLM", "start_time_us": 1,
            "end_time_us": 2}
    older, other = (RawRecord("streams.groups", 0, offset, b"g", value) for offset, value in
                    enumerate([codec.encode(history_schemas()[0], result), codec.encode(SPAN, span)]))
    processor = GroupProcessor(load_config(environ={}), None, None, None, codec)  # type: ignore[arg-type]
    (record, read), = processor.read([older, other])
    assert record is older and read == {**result, "drafts": []}  # an older RolloutResult gains the drafts default
    assert "undecodable group record" in caplog.text and "Span" in caplog.text


def test_a_huge_block_count_is_malformed_and_the_pattern_cache_stays_bounded():
    reader = compile_reader(IDS, raw_arrays=frozenset({"ids"}))
    body = write_long(2**40) + b"\x02\x04\x00" + b"\x00"
    outcome = read_within(reader, body)
    assert isinstance(outcome.get("error"), MalformedSpan), outcome
    for count in range(1, 3000):
        read_within(reader, write_long(count) + b"\x02" * count + b"\x00" + b"\x00", 5.0)
    assert span_reader.varint_run_cache_size() <= span_reader.VARINT_RUN_CACHE


@pytest.mark.parametrize("field", ["ids", "tags"])
def test_a_negative_block_count_with_a_negative_size_ends(field):
    raw = frozenset({"ids"}) if field == "ids" else frozenset()
    reader = compile_reader(IDS, raw_arrays=raw, skipped=frozenset({"tags"}))
    negative_block = write_long(-1) + write_long(-3)
    body = (negative_block + b"\x00") if field == "ids" else (b"\x00" + negative_block)
    outcome = read_within(reader, body * 4)
    assert isinstance(outcome.get("error"), MalformedSpan), outcome

"""Avro container files built from raw record bodies read back with fastavro."""

from __future__ import annotations

import io

import fastavro

from agentstream.schemas import AvroCodec
from agentstream.schemas.container_file import container_file


def test_container_file_of_raw_bodies_reads_back():
    codec = AvroCodec()
    spans = [{"span_id": f"s{i}", "rollout_id": "r", "attempt_id": "a", "name": "n", "kind": "LLM",
              "start_time_us": i, "end_time_us": i + 1, "attributes": {"k": "v"}, "prompt_token_ids": [i, 2],
              "response_token_ids": [3], "response_logprobs": [-0.5]} for i in range(3)]
    records = [codec.encode_span_batch(spans[:2]), codec.encode_span_batch(spans[2:])]
    _, _, schema = codec.writer_schema(records[0])
    read = list(fastavro.reader(io.BytesIO(container_file(schema, [r[5:] for r in records]))))
    assert [s["span_id"] for batch in read for s in batch["spans"]] == ["s0", "s1", "s2"]
    assert read[1]["spans"][0]["prompt_token_ids"] == [2, 2]

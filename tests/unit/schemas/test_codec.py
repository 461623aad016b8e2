"""The Avro schemas and the Confluent wire-format codec: round trips, the wire header, errors, evolution, interop."""

from __future__ import annotations

import copy
import datetime as dt
import io
import json
import random
from pathlib import Path
from typing import Any

import avro.io
import avro.schema
import pytest

import agentstream.schemas as schemas
from agentstream.schemas import (
    SPAN,
    SPAN_BATCH,
    AvroCodec,
    BundledRegistry,
    CodecError,
    EncodeError,
    IncompatibleSchema,
    MalformedRecord,
    NotWireFormat,
    SchemaIdCollision,
    UnknownRecordName,
    UnknownSchemaId,
    current_schemas,
    schema_id,
    self_contained,
)
from tests.support.avro_samples import (
    AVRO_DIR,
    PINNED_IDS,
    SAMPLES,
    T0,
    llm_span,
    newer_span_schema,
    raw_schema,
    reward_span,
)

# --- round trips -------------------------------------------------------------------------


def test_samples_cover_every_bundled_record() -> None:
    assert set(SAMPLES) == set(current_schemas())


@pytest.mark.parametrize("record_name", sorted(SAMPLES))
def test_every_record_round_trips(codec: AvroCodec, record_name: str) -> None:
    data = codec.encode(record_name, SAMPLES[record_name])
    assert codec.decode(data) == (record_name, SAMPLES[record_name])


def test_short_names_are_in_the_current_namespace(codec: AvroCodec) -> None:
    assert codec.encode("Span", llm_span()) == codec.encode(SPAN, llm_span())


def test_omitted_optional_fields_decode_as_their_defaults(codec: AvroCodec) -> None:
    required = {key: llm_span()[key] for key in ("span_id", "rollout_id", "attempt_id", "name", "kind")}
    minimal = {**required, "start_time_us": T0, "end_time_us": T0 + 1}
    _, value = codec.decode(codec.encode("Span", minimal))
    assert value == {
        **minimal,
        "parent_id": None,
        "status": "UNSET",
        "status_message": None,
        "agent_name": None,
        "task_id": None,
        "group_id": None,
        "model": None,
        "attributes": {},
        "prompt_token_ids": None,
        "response_token_ids": None,
        "response_logprobs": None,
        "reward": None,
        "reward_dimensions": None,
        "policy_version": None,
    }


def test_span_batch_holds_many_spans(codec: AvroCodec) -> None:
    spans = [llm_span(span_id=f"s{i}", response_token_ids=list(range(i))) for i in range(50)]
    name, value = codec.decode(codec.encode_span_batch(spans))
    assert name == SPAN_BATCH
    assert value["spans"] == spans


def test_encoding_does_not_modify_the_value(codec: AvroCodec) -> None:
    batch = {"spans": [llm_span(), reward_span()]}
    before = copy.deepcopy(batch)
    codec.encode(SPAN_BATCH, batch)
    assert batch == before


def test_timestamps_stay_integer_microseconds(codec: AvroCodec) -> None:
    _, value = codec.decode(codec.encode("Span", llm_span()))
    assert type(value["start_time_us"]) is int and value["start_time_us"] == T0


# --- wire format -------------------------------------------------------------------------


def test_wire_header_is_magic_byte_then_big_endian_schema_id(codec: AvroCodec) -> None:
    data = codec.encode("Span", llm_span())
    span_id = schema_id(current_schemas()[SPAN])
    assert data[0] == 0
    assert data[1:5] == span_id.to_bytes(4, "big")
    assert len(data) > 5 + 100  # the Avro body follows


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x00\x00\x00\x00", b"\x01\x00\x00\x00\x01\x02", b"\xff" * 64])
def test_bytes_not_in_wire_format_are_rejected(codec: AvroCodec, data: bytes) -> None:
    with pytest.raises(NotWireFormat):
        codec.decode(data)


def test_unknown_schema_id_is_rejected(codec: AvroCodec) -> None:
    known = set(PINNED_IDS.values())
    unknown = next(i for i in range(1, 100) if i not in known)
    with pytest.raises(UnknownSchemaId) as raised:
        codec.decode(b"\x00" + unknown.to_bytes(4, "big") + b"\x02x")
    assert raised.value.schema_id == unknown


def test_trailing_bytes_are_rejected(codec: AvroCodec) -> None:
    with pytest.raises(MalformedRecord, match="1 bytes left"):
        codec.decode(codec.encode("Span", llm_span()) + b"\x00")


def test_every_truncation_is_rejected(codec: AvroCodec) -> None:
    for record_name, value in SAMPLES.items():
        data = codec.encode(record_name, value)
        for length in range(len(data)):
            with pytest.raises(NotWireFormat if length < 5 else MalformedRecord):
                codec.decode(data[:length])


def test_garbage_raises_only_codec_errors(codec: AvroCodec) -> None:
    rng = random.Random(20261121)
    headers = [b"\x00" + schema_id.to_bytes(4, "big") for schema_id in PINNED_IDS.values()]
    valid = [codec.encode(name, value) for name, value in SAMPLES.items()]
    blobs = []
    for _ in range(3000):
        blobs.append(rng.randbytes(rng.randrange(40)))  # anything at all
        blobs.append(rng.choice(headers) + rng.randbytes(rng.randrange(300)))  # a known id, a random body
        mutated = bytearray(rng.choice(valid))  # a valid record with a few bytes flipped
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(5, len(mutated))] = rng.randrange(256)
        blobs.append(bytes(mutated))
    rejected = 0
    for blob in blobs:
        for reader in (None, SPAN):
            try:
                codec.decode(blob, reader)
            except CodecError:  # anything else escapes and fails the test
                rejected += 1
    assert rejected > len(blobs)  # most garbage must be caught, not decoded into nonsense


def test_errors_chain_their_cause(codec: AvroCodec) -> None:
    with pytest.raises(MalformedRecord) as raised:
        codec.decode(codec.encode("Span", llm_span())[:20])
    assert isinstance(raised.value.__cause__, Exception)


@pytest.mark.parametrize(
    ("value", "mentioned"),
    [
        (llm_span(start_time_us="yesterday"), "start_time_us"),
        (llm_span(kind="NOT_A_KIND"), "kind"),
        (llm_span(prompt_token_ids=[1, "two"]), "prompt_token_ids"),
        (llm_span(reward="high"), "reward"),
        (llm_span(attributes={"gen_ai.usage.input_tokens": 12}), "attributes"),
        ({key: value for key, value in llm_span().items() if key != "span_id"}, "span_id"),
        (llm_span(reward_dimension={"typo": 1.0}), "reward_dimension"),
    ],
)
def test_values_that_do_not_match_name_the_field(codec: AvroCodec, value: dict[str, Any], mentioned: str) -> None:
    with pytest.raises(EncodeError, match=mentioned):
        codec.encode("Span", value)


def test_a_value_that_is_not_a_record_is_an_encode_error(codec: AvroCodec) -> None:
    with pytest.raises(EncodeError):
        codec.encode("Span", "not a span")  # type: ignore[arg-type]


def test_unknown_record_name(codec: AvroCodec) -> None:
    with pytest.raises(UnknownRecordName):
        codec.encode("Spam", {})
    with pytest.raises(UnknownRecordName):
        codec.decode(codec.encode("Span", llm_span()), reader_schema="io.agentstream.v0.Span")


def test_every_error_is_a_codec_error() -> None:
    for error in (NotWireFormat, UnknownSchemaId, MalformedRecord, IncompatibleSchema, SchemaIdCollision, EncodeError):
        assert issubclass(error, CodecError)


# --- evolution ---------------------------------------------------------------------------


def test_newer_reader_reads_records_written_with_the_current_schema(codec: AvroCodec) -> None:
    _, value = codec.decode(codec.encode("Span", llm_span()), reader_schema=newer_span_schema())
    assert value == {**llm_span(), "time_to_first_token_us": None}


def test_current_reader_reads_records_written_with_a_newer_schema() -> None:
    newer = newer_span_schema()
    written = llm_span(kind="RETRIEVAL", time_to_first_token_us=40_000)
    producer_registry, consumer_registry = BundledRegistry(), BundledRegistry()
    data = AvroCodec(producer_registry).encode(newer, written)
    consumer = AvroCodec(consumer_registry)
    with pytest.raises(UnknownSchemaId):
        consumer.decode(data)  # nobody told the consumer about the newer writer schema yet

    consumer_registry.register(self_contained(newer))
    assert consumer.decode(data) == (SPAN, written)  # as written
    assert consumer.decode(data, reader_schema="Span") == (SPAN, llm_span(kind="OTHER"))  # as this release knows it


def test_a_reader_that_cannot_read_the_writer_is_incompatible(codec: AvroCodec) -> None:
    demanding = raw_schema("span.avsc")
    demanding["fields"].append({"name": "must_have", "type": "string"})  # no default
    with pytest.raises(IncompatibleSchema):
        codec.decode(codec.encode("Span", llm_span()), reader_schema=demanding)


def test_retired_schemas_in_history_stay_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old_span = raw_schema("span.avsc")
    old_span["fields"] = [field for field in old_span["fields"] if field["name"] != "policy_version"]
    (tmp_path / "span.1.avsc").write_text(json.dumps(old_span))
    monkeypatch.setattr(schemas.catalog, "_HISTORY_DIR", tmp_path)
    schemas.catalog.history_schemas.cache_clear()
    try:
        old_id = schema_id(self_contained(old_span))
        old_value = {key: value for key, value in llm_span().items() if key != "policy_version"}
        data = AvroCodec(BundledRegistry()).encode(old_span, old_value)
        reader = AvroCodec(BundledRegistry())  # knows the old id from history/ alone
        assert data[1:5] == old_id.to_bytes(4, "big")
        assert reader.decode(data, reader_schema="Span") == (SPAN, llm_span(policy_version=None))
    finally:
        schemas.catalog.history_schemas.cache_clear()


# --- interoperability --------------------------------------------------------------------


def _as_datetime(micros: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=micros)


def test_apache_avro_reads_our_span(codec: AvroCodec) -> None:
    span = llm_span(reward=0.5, reward_dimensions={"correctness": 1.0})
    data = codec.encode("Span", span)
    writer_schema = avro.schema.parse((AVRO_DIR / "span.avsc").read_text())
    decoded = avro.io.DatumReader(writer_schema).read(avro.io.BinaryDecoder(io.BytesIO(data[5:])))
    assert decoded == {
        **span,
        "start_time_us": _as_datetime(span["start_time_us"]),  # it applies the timestamp-micros logical type
        "end_time_us": _as_datetime(span["end_time_us"]),
    }


def test_we_read_a_span_apache_avro_wrote(codec: AvroCodec) -> None:
    span = llm_span()
    writer_schema = avro.schema.parse((AVRO_DIR / "span.avsc").read_text())
    body = io.BytesIO()
    as_avro_writes_it = {
        **span,
        "start_time_us": _as_datetime(span["start_time_us"]),
        "end_time_us": _as_datetime(span["end_time_us"]),
    }
    avro.io.DatumWriter(writer_schema).write(as_avro_writes_it, avro.io.BinaryEncoder(body))
    header = b"\x00" + PINNED_IDS[SPAN].to_bytes(4, "big")
    assert codec.decode(header + body.getvalue()) == (SPAN, span)

"""The hand-written Span/SpanBatch encoder: the datums fastavro writes (token ids as one sized block), readable by
fastavro and Apache Avro."""

from __future__ import annotations

import io
import json
import math
import random
import struct
from typing import Any

import avro.io
import avro.schema
import numpy as np
import pytest

from agentstream.schemas import (
    SPAN,
    SPAN_BATCH,
    AvroCodec,
    EncodeError,
    current_schemas,
    self_contained,
)
from agentstream.schemas.binary import write_long
from agentstream.schemas.span_writer import (
    NBYTES,
    SpanBatchEncoder,
    prepare_span,
)

SEED = 20241121
INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)
OPTIONAL_STRINGS = ("parent_id", "status_message", "agent_name", "task_id", "group_id", "model")
KINDS = ("LLM", "TOOL", "REWARD", "MESSAGE", "EXCEPTION", "OBJECT", "AGENT", "ROLLOUT", "OTHER")


@pytest.fixture(scope="module")
def codec() -> AvroCodec:
    return AvroCodec()


@pytest.fixture(scope="module")
def encoder() -> SpanBatchEncoder:
    return SpanBatchEncoder()


def random_text(rng: random.Random) -> str:
    """Short text mixing ASCII, accented letters, CJK, emoji and other planes (no lone surrogates)."""
    alphabets = ("abcxyz019-_. ", "éüßñçøå", "日本語中文한국어", "😀🚀🧪",
                 "\u0000\u007f\u0080\u07ff\u0800\uffff\U00010000\U0010ffff")
    length = rng.choice((0, 1, 2, 5, 17, 63, 64, 65, 200))
    return "".join(rng.choice(rng.choice(alphabets)) for _ in range(length))


def random_int(rng: random.Random, low: int, high: int) -> int:
    """Mostly the varint size boundaries and extremes of [low, high], sometimes anything in it."""
    boundaries = [0, 1, -1, 63, 64, -64, -65, 8191, 8192, -8193, 1 << 20, -(1 << 20) - 1, 1 << 27, -(1 << 27) - 1,
                  1 << 30, 1 << 40, -(1 << 50), low, high, low + 1, high - 1]
    if rng.random() < 0.5:
        return rng.randint(low, high)
    return min(high, max(low, rng.choice(boundaries)))


def random_float(rng: random.Random) -> float:
    special = (0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, 3.4e38, 1e300, -1e300, 5e-324, 1.0, -1.5)
    return rng.choice(special) if rng.random() < 0.2 else rng.uniform(-30.0, 5.0)


def random_span(rng: random.Random) -> dict[str, Any]:
    """A span exercising every field: absent and null optional fields, empty containers, extreme numbers."""
    span: dict[str, Any] = {
        "span_id": random_text(rng),
        "rollout_id": random_text(rng),
        "attempt_id": random_text(rng),
        "name": random_text(rng),
        "kind": rng.choice(KINDS),
        "start_time_us": random_int(rng, *INT64),
        "end_time_us": random_int(rng, *INT64),
    }
    if rng.random() < 0.8:
        span["status"] = rng.choice(("UNSET", "OK", "ERROR"))
    for name in OPTIONAL_STRINGS:
        choice = rng.random()
        if choice < 0.6:
            span[name] = random_text(rng)
        elif choice < 0.8:
            span[name] = None
    if rng.random() < 0.8:
        span["attributes"] = {random_text(rng): random_text(rng) for _ in range(rng.choice((0, 1, 3, 70)))}
    for name in ("prompt_token_ids", "response_token_ids"):
        choice = rng.random()
        if choice < 0.7:
            span[name] = [random_int(rng, *INT32) for _ in range(rng.choice((0, 1, 5, 100, 300)))]
        elif choice < 0.85:
            span[name] = None
    if rng.random() < 0.7:
        span["response_logprobs"] = [random_float(rng) for _ in range(rng.choice((0, 1, 7, 100)))]
    elif rng.random() < 0.5:
        span["response_logprobs"] = None
    if rng.random() < 0.6:
        span["reward"] = rng.choice((random_float(rng), rng.randint(-5, 5), None))
    if rng.random() < 0.6:
        span["reward_dimensions"] = rng.choice(
            (None, {}, {random_text(rng): random_float(rng) for _ in range(rng.randint(1, 4))}))
    if rng.random() < 0.7:
        span["policy_version"] = rng.choice((None, random_int(rng, *INT64)))
    return span


def random_spans(count: int, seed: int = SEED) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_span(rng) for _ in range(count)]


# --- what fastavro writes ---------------------------------------------------------------------


def without_token_ids(span: dict[str, Any]) -> dict[str, Any]:
    return {**span, "prompt_token_ids": None if span.get("prompt_token_ids") is None else [],
            "response_token_ids": None if span.get("response_token_ids") is None else []}


def test_single_spans_are_the_datums_fastavro_writes(codec: AvroCodec, encoder: SpanBatchEncoder) -> None:
    for index, span in enumerate(random_spans(600)):
        ours = encoder.encode_span(span)
        assert same(codec.decode(ours)[1], codec.decode(codec.encode(SPAN, span))[1]), f"span {index}: {span}"
        # only the token-id blocks differ from fastavro's bytes
        assert encoder.encode_span(without_token_ids(span)) == codec.encode(SPAN, without_token_ids(span)), index


def test_token_ids_are_one_block_with_its_byte_size(codec: AvroCodec, encoder: SpanBatchEncoder) -> None:
    span = {"span_id": "s", "rollout_id": "r", "attempt_id": "a", "name": "chat", "kind": "LLM",
            "start_time_us": 1, "end_time_us": 2, "prompt_token_ids": [1, 300, -70000], "response_token_ids": [5]}
    varints = write_long(1) + write_long(300) + write_long(-70000)
    blocks = (b"\x02" + write_long(-3) + write_long(len(varints)) + varints + b"\x00"
              + b"\x02" + write_long(-1) + write_long(1) + write_long(5) + b"\x00")
    assert blocks in encoder.encode_span(span)
    assert codec.decode(encoder.encode_span(span))[1]["prompt_token_ids"] == [1, 300, -70000]


def test_span_batches_are_the_datums_fastavro_writes(codec: AvroCodec, encoder: SpanBatchEncoder) -> None:
    rng = random.Random(SEED + 1)
    spans = random_spans(400, SEED + 1)
    batches, start = [], 0
    while start < len(spans):
        size = rng.choice((0, 1, 2, 9, 40))
        batches.append(spans[start:start + size])
        start += size
    expected = [codec.decode(codec.encode(SPAN_BATCH, {"spans": batch}))[1] for batch in batches]
    singly = [encoder.encode_span_batch(batch) for batch in batches]
    assert same([codec.decode(data)[1] for data in singly], expected)
    # All batches at once: every token id's varint written in one call, split back per record.
    assert encoder.encode_batches([[prepare_span(span) for span in batch] for batch in batches]) == singly
    plain = [[without_token_ids(span) for span in batch] for batch in batches]
    assert [encoder.encode_span_batch(batch) for batch in plain] == [
        codec.encode(SPAN_BATCH, {"spans": batch}) for batch in plain]


def test_the_empty_batch(codec: AvroCodec, encoder: SpanBatchEncoder) -> None:
    assert encoder.encode_span_batch([]) == codec.encode(SPAN_BATCH, {"spans": []})
    assert encoder.encode_batches([]) == []


def test_numpy_arrays_encode_like_lists(encoder: SpanBatchEncoder) -> None:
    for span in random_spans(100, SEED + 2):
        as_numpy = dict(span)
        for name, dtype in (("prompt_token_ids", np.int64), ("response_token_ids", np.int32),
                            ("response_logprobs", np.float64)):
            if span.get(name) is not None:
                as_numpy[name] = np.array(span[name], dtype=dtype)
        assert encoder.encode_span(as_numpy) == encoder.encode_span(span)


def test_varints_match_the_definition_at_every_size_boundary(encoder: SpanBatchEncoder) -> None:
    def reference(value: int) -> bytes:
        zigzag, out = (value << 1) ^ (value >> 63), bytearray()
        while zigzag > 0x7F:
            out.append(zigzag & 0x7F | 0x80)
            zigzag >>= 7
        return bytes(out + bytes([zigzag]))

    edges = [sign * (1 << bits) + delta for bits in range(0, 31, 1) for sign in (1, -1) for delta in (-1, 0, 1)]
    values = [v for v in edges + list(INT32) if INT32[0] <= v <= INT32[1]]
    rng = random.Random(SEED)
    values += [rng.randint(*INT32) for _ in range(200_000)]  # more than one vectorized chunk
    for start in range(0, len(values), 50_000):  # one span's prompt ids each: a block of their varints
        ids = values[start:start + 50_000]
        varints = b"".join(map(reference, ids))
        body = encoder.encode_span({"span_id": "s", "rollout_id": "r", "attempt_id": "a", "name": "chat",
                                    "kind": "LLM", "start_time_us": 1, "end_time_us": 2, "prompt_token_ids": ids})
        assert reference(-len(ids)) + reference(len(varints)) + varints in body
    for value in [*values[:500], INT64[0], INT64[1], 1_732_200_000_000_000, -1_732_200_000_000_000]:
        assert write_long(value) == reference(value)


# --- readers agree ---------------------------------------------------------------------------


def same(left: Any, right: Any) -> bool:
    """Equality where NaN equals NaN."""
    if isinstance(left, float) and isinstance(right, float):
        return (math.isnan(left) and math.isnan(right)) or left == right
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(same(left[key], right[key]) for key in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(same, left, right))
    return left == right


def expected_value(span: dict[str, Any]) -> dict[str, Any]:
    """What a reader returns for `span`: defaults filled in, floats rounded to float32, ints as doubles."""
    defaults = {name: None for name in (*OPTIONAL_STRINGS, "prompt_token_ids", "response_token_ids",
                                         "response_logprobs", "reward", "reward_dimensions", "policy_version")}
    value = {**defaults, "status": "UNSET", "attributes": {}, **span}
    if value["response_logprobs"] is not None:
        value["response_logprobs"] = [struct.unpack("<f", struct.pack("<f", x if abs(x) < 3.5e38 else x * math.inf))[0]
                                      for x in value["response_logprobs"]]
    if value["reward"] is not None:
        value["reward"] = float(value["reward"])
    return value


def apache_reader(record_name: str) -> avro.io.DatumReader:
    """An Apache Avro reader of the bundled schema, without logical types (timestamps stay integers)."""
    plain = self_contained(current_schemas()[record_name], logical_types=False)
    return avro.io.DatumReader(avro.schema.parse(json.dumps(plain)))


def test_fastavro_and_apache_avro_read_back_the_values(codec: AvroCodec, encoder: SpanBatchEncoder) -> None:
    spans = random_spans(150, SEED + 3)
    data = encoder.encode_span_batch(spans)
    expected = [expected_value(span) for span in spans]

    name, by_fastavro = codec.decode(data)
    assert name == SPAN_BATCH
    assert same(by_fastavro["spans"], expected)

    by_apache = apache_reader(SPAN_BATCH).read(avro.io.BinaryDecoder(io.BytesIO(data[5:])))
    assert same(by_apache["spans"], expected)

    for span, value in zip(spans[:50], expected, strict=False):  # the first 50
        single = encoder.encode_span(span)
        assert same(codec.decode(single)[1], value)
        assert same(apache_reader(SPAN).read(avro.io.BinaryDecoder(io.BytesIO(single[5:]))), value)


# --- invalid values --------------------------------------------------------------------------


def valid_span() -> dict[str, Any]:
    return {"span_id": "s", "rollout_id": "r", "attempt_id": "a", "name": "chat", "kind": "LLM",
            "start_time_us": 1, "end_time_us": 2, "prompt_token_ids": [1, 2], "response_logprobs": [-0.5]}


@pytest.mark.parametrize(("field", "value"), [
    ("span_id", None),
    ("span_id", 7),
    ("name", b"bytes"),
    ("name", "\ud800"),
    ("parent_id", 5),
    ("kind", "NOPE"),
    ("kind", ["LLM"]),
    ("status", "FINE"),
    ("start_time_us", "now"),
    ("end_time_us", 1 << 63),
    ("attributes", {"k": 1}),
    ("attributes", {1: "v"}),
    ("attributes", ["k", "v"]),
    ("attributes", {"k": ["v"]}),
    ("prompt_token_ids", [1, "two"]),
    ("prompt_token_ids", "123"),
    ("response_logprobs", ["x"]),
    ("response_logprobs", np.array(["x"])),
    ("reward", "high"),
    ("reward", True),
    ("reward_dimensions", {"a": "x"}),
    ("reward_dimensions", [1.0]),
    ("policy_version", 2.0),
    ("policy_version", True),
])
def test_values_fastavro_rejects_are_encode_errors(codec: AvroCodec, encoder: SpanBatchEncoder,
                                                    field: str, value: Any) -> None:
    span = {**valid_span(), field: value}
    with pytest.raises(EncodeError):
        codec.encode(SPAN, span)
    with pytest.raises(EncodeError, match=field):
        encoder.encode_span(span)


@pytest.mark.parametrize(("field", "value"), [
    ("prompt_token_ids", [1 << 31]),
    ("prompt_token_ids", np.array([-(1 << 31) - 1])),
    ("response_token_ids", [1.0]),
    ("response_token_ids", np.array([1.5])),
    ("start_time_us", 1.0),
    ("start_time_us", True),
])
def test_stricter_than_fastavro_on_ints(encoder: SpanBatchEncoder, field: str, value: Any) -> None:
    with pytest.raises(EncodeError, match=field):
        encoder.encode_span({**valid_span(), field: value})


def test_missing_required_and_unknown_fields_are_encode_errors(encoder: SpanBatchEncoder) -> None:
    span = valid_span()
    del span["kind"]
    with pytest.raises(EncodeError, match="kind"):
        encoder.encode_span(span)
    with pytest.raises(EncodeError, match="more fields"):
        encoder.encode_span({**valid_span(), "extra": 1})


def test_a_value_that_is_not_a_record_is_an_encode_error(encoder: SpanBatchEncoder) -> None:
    for value in (None, 5, ["span"]):
        with pytest.raises(EncodeError, match="not a record"):
            encoder.encode_span(value)


def test_prepared_span_reports_the_memory_it_holds() -> None:
    prepared = prepare_span({**valid_span(), "prompt_token_ids": list(range(100)), "response_token_ids": [1] * 50})
    head, prompt, middle, response, tail, nbytes = prepared
    assert nbytes == len(head) + len(middle) + len(tail) + 4 * 150 and len(prompt) == 400 and len(response) == 200
    assert nbytes == prepared[NBYTES]


def test_the_encoder_refuses_a_span_schema_it_does_not_write(monkeypatch) -> None:
    """prepare_span writes the Span fields by hand: a changed schema must stop the encoder, not produce garbage."""
    from agentstream.schemas import span_writer

    monkeypatch.setattr(span_writer, "SPAN_SCHEMA_ID", span_writer.SPAN_SCHEMA_ID + 1)
    with pytest.raises(EncodeError, match=r"update agentstream\.schemas\.span_writer"):
        SpanBatchEncoder()

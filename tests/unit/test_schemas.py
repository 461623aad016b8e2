"""The Avro schemas and the Confluent wire-format codec: round trips, ids, errors, evolution, interop."""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import avro.io
import avro.schema
import fastavro
import pytest
from fastavro.schema import to_parsing_canonical_form

import schemas
from schemas import (
    ANNOUNCEMENT,
    CHECKPOINT,
    DEAD_LETTER,
    DEPLOYMENT,
    ROLLOUT_EVENT,
    ROLLOUT_RESULT,
    SPAN,
    SPAN_BATCH,
    TASK,
    TRANSITION,
    TRANSITION_BATCH,
    AvroCodec,
    BundledRegistry,
    CodecError,
    EncodeError,
    IncompatibleSchema,
    MalformedRecord,
    NotWireFormat,
    Schema,
    SchemaIdCollision,
    UnknownRecordName,
    UnknownSchemaId,
    current_schemas,
    schema_id,
    self_contained,
)

ROOT = Path(__file__).resolve().parents[2]
AVRO_DIR = ROOT / "schemas" / "avro"

# Changing a current schema changes its id. Before you do, copy the old file to
# schemas/avro/history/ (see the README there) so records already on Kafka stay readable;
# then update the id here.
PINNED_IDS = {
    ANNOUNCEMENT: 1743986076,
    CHECKPOINT: 1836988109,
    DEAD_LETTER: 208212813,
    DEPLOYMENT: 1973247138,
    ROLLOUT_EVENT: 1187672618,
    ROLLOUT_RESULT: 1881895367,
    SPAN: 1310064008,
    SPAN_BATCH: 692827969,
    TASK: 87156492,
    TRANSITION: 1993928380,
    TRANSITION_BATCH: 2086229143,
}

T0 = 1_732_200_000_000_000  # 2024-11-21T14:40:00Z in microseconds


def llm_span(**overrides: Any) -> dict[str, Any]:
    """A complete LLM span, every field given; logprobs are exact in float32 so they round-trip equal."""
    span = {
        "span_id": "3f2a9c1e8b7d4a60",
        "rollout_id": "ro-7f3e2d1c",
        "attempt_id": "at-1",
        "parent_id": "1122334455667788",
        "name": "chat Qwen2.5-0.5B-Instruct",
        "kind": "LLM",
        "start_time_us": T0,
        "end_time_us": T0 + 250_000,
        "status": "OK",
        "status_message": None,
        "agent_name": "math-agent",
        "task_id": "gsm8k-00042",
        "group_id": "g-42",
        "model": "Qwen2.5-0.5B-Instruct",
        "attributes": {"gen_ai.system": "openai", "gen_ai.request.model": "Qwen2.5-0.5B-Instruct"},
        "prompt_token_ids": [151644, 8948, 198, 0],
        "response_token_ids": [785, 4226, 374],
        "response_logprobs": [-0.5, -1.25, -0.0625],
        "reward": None,
        "reward_dimensions": None,
        "policy_version": 7,
    }
    return {**span, **overrides}


def reward_span() -> dict[str, Any]:
    return llm_span(
        span_id="aa00",
        name="reward",
        kind="REWARD",
        status="UNSET",
        model=None,
        attributes={},
        prompt_token_ids=None,
        response_token_ids=None,
        response_logprobs=None,
        reward=0.75,
        reward_dimensions={"correctness": 1.0, "format": 0.5},
        policy_version=None,
    )


SAMPLES: dict[str, dict[str, Any]] = {
    SPAN: llm_span(),
    SPAN_BATCH: {"spans": [llm_span(), reward_span()]},
    TASK: {
        "task_id": "gsm8k-00042",
        "rollout_id": "ro-7f3e2d1c",
        "group_id": "g-42",
        "agent_name": "math-agent",
        "input": json.dumps({"question": "2+2?"}),
        "attempt": 2,
        "max_attempts": 3,
        "timeout_s": 120.0,
        "enqueued_at_us": T0,
        "metadata": {"dataset": "gsm8k", "split": "train"},
    },
    ROLLOUT_EVENT: {
        "rollout_id": "ro-7f3e2d1c",
        "attempt_id": "at-1",
        "event": "FAILED",
        "at_us": T0,
        "worker_id": "runner-3",
        "error": "ValueError: boom",
        "task_id": "gsm8k-00042",
        "agent_name": "math-agent",
    },
    TRANSITION: {
        "transition_id": "tr-1",
        "rollout_id": "ro-7f3e2d1c",
        "span_id": "3f2a9c1e8b7d4a60",
        "agent_name": "math-agent",
        "model": "Qwen2.5-0.5B-Instruct",
        "policy_version": 7,
        "step_index": 0,
        "prompt_token_ids": [151644, 8948],
        "response_token_ids": [785, 4226],
        "behaviour_logprobs": [-0.5, -2.0],
        "loss_mask": [],
        "merged_calls": 1,
        "split_at_break": False,
        "reward": 1.0,
        "return_value": 0.9,
        "advantage": -0.125,
        "group_id": None,
        "created_at_us": T0,
    },
    TRANSITION_BATCH: {
        "transitions": [{
            "transition_id": "tr-2", "rollout_id": "ro-1", "span_id": "sp-1", "agent_name": "math-agent",
            "model": "m", "policy_version": 1, "step_index": 0, "prompt_token_ids": [1], "response_token_ids": [2],
            "behaviour_logprobs": [-0.25], "loss_mask": [True], "merged_calls": 1, "split_at_break": False,
            "reward": 1.0, "return_value": 1.0, "advantage": 0.5, "group_id": "g",
            "created_at_us": T0,
        }],
    },
    CHECKPOINT: {
        "model": "Qwen2.5-0.5B-Instruct",
        "version": 8,
        "uri": "file:///var/lib/agentstream/ckpt/8.safetensors",
        "sha256": "ab" * 32,
        "step": 800,
        "created_at_us": T0,
        "metrics": {"loss": 0.25, "reward_mean": 0.5},
        "format": "lora",
    },
    ROLLOUT_RESULT: {
        "rollout_id": "ro-7f3e2d1c",
        "attempt_id": "at-2",
        "group_id": "g-42",
        "agent_name": "math-agent",
        "status": "SUCCEEDED",
        "final_reward": 0.75,
        "completed_at_us": T0,
        "drafts": [{"model": "m", "head": b"\x08tr-1"}],
    },
    DEPLOYMENT: {
        "decision_id": "d-1",
        "model": "Qwen2.5-0.5B-Instruct",
        "version": 9,
        "action": "CANARY",
        "decided_by": "gate",
        "reason": "evaluation: 0.812 vs v8's 0.797 on 64 tasks; canary on 10% of live rollouts",
        "format": "lora",
        "stable_version": 8,
        "stable_uri": "file:///var/lib/agentstream/ckpt/v8",
        "canary_version": 9,
        "canary_share": 0.1,
        "candidate_version": None,
        "candidate_score": 0.8125,
        "stable_score": 0.796875,
        "eval_tasks": 64,
        "canary_reward": None,
        "canary_rollouts": 0,
        "stable_reward": None,
        "stable_rollouts": 0,
        "at_us": T0,
    },
    ANNOUNCEMENT: {
        "model": "SmolLM2-135M-Instruct",
        "role": "gate",
        "gated": True,
        "instance": "host-1:4242:9f2c",
        "at_us": T0,
        "live_s": 20.0,
    },
    DEAD_LETTER: {
        "source_topic": "agentstream.spans",
        "partition": 3,
        "offset": 2**40,
        "key": b"ro-7f3e2d1c",
        "value": b"\x00\xff garbage",
        "error": "magic byte is 255, expected 0",
        "error_type": "NotWireFormat",
        "at_us": T0,
    },
}


@pytest.fixture(scope="module")
def codec() -> AvroCodec:
    return AvroCodec()


def raw_schema(file_name: str) -> dict[str, Any]:
    return json.loads((AVRO_DIR / file_name).read_text())


def newer_span_schema() -> dict[str, Any]:
    """Span as a later release might define it: one more field, one more SpanKind symbol."""
    newer = raw_schema("span.avsc")
    kind = next(field for field in newer["fields"] if field["name"] == "kind")
    kind["type"]["symbols"].append("RETRIEVAL")
    newer["fields"].append({"name": "time_to_first_token_us", "type": ["null", "long"], "default": None})
    return newer


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


# --- wire format and ids -----------------------------------------------------------------


def test_wire_header_is_magic_byte_then_big_endian_schema_id(codec: AvroCodec) -> None:
    data = codec.encode("Span", llm_span())
    span_id = schema_id(current_schemas()[SPAN])
    assert data[0] == 0
    assert data[1:5] == span_id.to_bytes(4, "big")
    assert len(data) > 5 + 100  # the Avro body follows


def test_schema_id_is_first_31_bits_of_sha256_of_canonical_form() -> None:
    for schema in current_schemas().values():
        digest = hashlib.sha256(to_parsing_canonical_form(schema).encode()).digest()
        assert schema_id(schema) == int.from_bytes(digest[:4], "big") >> 1
        assert 0 < schema_id(schema) < 2**31


def test_current_ids_are_pinned() -> None:
    ids = {name: schema_id(schema) for name, schema in current_schemas().items()}
    assert ids == PINNED_IDS, "a schema changed: keep the old version in schemas/avro/history/, then re-pin"


def test_ids_are_stable_across_processes() -> None:
    program = (
        "import json, schemas\n"
        "print(json.dumps({n: schemas.schema_id(s) for n, s in schemas.current_schemas().items()}))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4242", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout) == {name: schema_id(schema) for name, schema in current_schemas().items()}


def test_ids_ignore_docs_and_defaults_but_not_structure() -> None:
    span = raw_schema("span.avsc")
    documented = copy.deepcopy(span)
    documented["doc"] = "reworded"
    documented["fields"][3]["doc"] = "reworded too"
    assert schema_id(self_contained(documented)) == schema_id(self_contained(span))
    assert schema_id(self_contained(newer_span_schema())) != schema_id(self_contained(span))


@pytest.mark.parametrize("file_name", sorted(p.name for p in AVRO_DIR.glob("*.avsc")
                                             if not p.name.endswith("_batch.avsc")))
def test_canonical_form_agrees_with_apache_avro(file_name: str) -> None:
    ours = to_parsing_canonical_form(self_contained(raw_schema(file_name)))
    theirs = avro.schema.parse((AVRO_DIR / file_name).read_text()).canonical_form
    # Apache avro for Python (1.12) leaves a logical-typed primitive as {"type":"long"} where
    # the specification (and Java) write "long"; everything else must agree byte for byte.
    assert ours == theirs.replace('{"type":"long"}', '"long"')


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


# --- registry ----------------------------------------------------------------------------


def test_bundled_registry_knows_every_current_schema() -> None:
    registry = BundledRegistry()
    for name, schema in current_schemas().items():
        assert registry.lookup(PINNED_IDS[name]) is schema
    with pytest.raises(UnknownSchemaId):
        registry.lookup(1)


def test_register_is_idempotent_and_returns_the_content_address() -> None:
    registry = BundledRegistry()
    newer = self_contained(newer_span_schema())
    assert registry.register(newer) == registry.register(newer) == schema_id(newer)
    assert registry.lookup(schema_id(newer)) is newer


def test_two_schemas_with_one_id_are_a_collision() -> None:
    # Found by a birthday search: these two canonical forms share their first 31 sha256 bits.
    first = fastavro.parse_schema({"type": "enum", "name": "Collide", "symbols": ["s9105"]})
    second = fastavro.parse_schema({"type": "enum", "name": "Collide", "symbols": ["s86826"]})
    assert schema_id(first) == schema_id(second)
    registry = BundledRegistry()
    registry.register(first)
    with pytest.raises(SchemaIdCollision):
        registry.register(second)
    assert registry.lookup(schema_id(first)) is first


class CountingRegistry:
    """A registry that numbers schemas in arrival order, as a Confluent schema registry would."""

    def __init__(self) -> None:
        self.schemas: list[Schema] = []
        self.lookups = 0

    def register(self, schema: Schema) -> int:
        canonical = [to_parsing_canonical_form(known) for known in self.schemas]
        if to_parsing_canonical_form(schema) not in canonical:
            self.schemas.append(schema)
            return len(self.schemas)
        return canonical.index(to_parsing_canonical_form(schema)) + 1

    def lookup(self, schema_id: int) -> Schema:
        self.lookups += 1
        if not 0 < schema_id <= len(self.schemas):
            raise UnknownSchemaId(schema_id)
        return self.schemas[schema_id - 1]


def test_any_registry_plugs_in() -> None:
    registry = CountingRegistry()
    codec = AvroCodec(registry)
    task = codec.encode("Task", SAMPLES[TASK])
    span = codec.encode("Span", llm_span())
    assert task[:5] == b"\x00\x00\x00\x00\x01" and span[:5] == b"\x00\x00\x00\x00\x02"
    for _ in range(3):
        assert codec.decode(span) == (SPAN, llm_span())
    assert registry.lookups == 1  # the codec caches what it looked up
    assert codec.decode(span, reader_schema="Span") == (SPAN, llm_span())
    assert len(registry.schemas) == 2  # reading registers nothing
    with pytest.raises(UnknownSchemaId):
        codec.decode(b"\x00\x00\x00\x00\x09\x00")


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

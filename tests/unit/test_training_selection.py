"""Training traffic selection: the train flag's contract, the SDK stamping it, the span reader finding it in the
attributes map, and the per-rollout decision (explicit opt-out, opt-in, then deterministic sampling)."""

from __future__ import annotations

import random

import fastavro
import pytest

from infra.config import ConfigError, CreditRule, load_config
from pipeline.sdk import Rollout, build_span, rollout
from schemas import AvroCodec
from schemas.contracts import TRAIN_ATTRIBUTE, TRAIN_HEADER, TrainFlagError, parse_train_flag
from schemas.span_reader import SpanReader
from streams.processor import STORED_SPANS_SQL, sample_point, training_choice
from streams.trajectory import SpanNode, assemble
from tests.support.sinks import ListSink

CODEC = AvroCodec()


# -- the contract ----------------------------------------------------------------------------------------------------

def test_contract_names():
    assert TRAIN_HEADER == "X-Agentstream-Train" and TRAIN_ATTRIBUTE == "agentstream.train"


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("  ", None),
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("On", True), (" true ", True),
    ("false", False), ("False", False), ("0", False), ("NO", False), ("off", False),
])
def test_parse_train_flag(value, expected):
    assert parse_train_flag(value) is expected


@pytest.mark.parametrize("value", ["maybe", "2", "tru", "true false", "-1", "y"])
def test_parse_train_flag_refuses_anything_else_with_a_named_error(value):
    with pytest.raises(TrainFlagError, match=r"training flag .* got") as caught:
        parse_train_flag(value)
    assert isinstance(caught.value, ValueError) and repr(value) in str(caught.value)


# -- the SDK ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("train, expected", [(True, "true"), (False, "false"), (None, None)])
def test_build_span_stamps_the_rollouts_choice_on_every_span(train, expected):
    owner = Rollout("r", "r-1", "agent", train=train)
    span = build_span(owner, "chat", "LLM", 1, 2, attributes={"gen_ai.system": "x", TRAIN_ATTRIBUTE: "maybe"})
    assert span["attributes"].get(TRAIN_ATTRIBUTE) == (expected or "maybe"), "the rollout's choice overrides"
    assert span["attributes"]["gen_ai.system"] == "x"
    bare = build_span(owner, "reward", "REWARD", 1, 1)
    assert bare["attributes"].get(TRAIN_ATTRIBUTE) == expected


def test_sdk_rollout_train_argument_reaches_its_spans():
    import agentstream as ags

    sink = ListSink()
    with ags.rollout("agent", sink=sink, train=False) as state:
        assert state.train is False
        with ags.span("plan"):
            pass
        ags.emit_reward(1.0)
    assert len(sink.spans) == 3 and all(s["attributes"][TRAIN_ATTRIBUTE] == "false" for s in sink.spans)
    sink = ListSink()
    with rollout("agent", sink=sink) as state:
        assert state.train is None
        ags.emit_reward(1.0)
    assert all(TRAIN_ATTRIBUTE not in s["attributes"] for s in sink.spans)


# -- the config ------------------------------------------------------------------------------------------------------

def _config_with(tmp_path, rule: str):
    path = tmp_path / "agentstream.toml"
    path.write_text(f"[[credit]]\nagent = \"*\"\n{rule}\n")
    return load_config(environ={"AGENTSTREAM_CONFIG": str(path), "AGENTSTREAM_HOME": str(tmp_path)})


def test_sample_rate_defaults_to_one_and_is_validated(tmp_path):
    assert CreditRule().sample_rate == 1.0
    assert _config_with(tmp_path, "sample_rate = 0.25").credit[0].sample_rate == 0.25
    assert _config_with(tmp_path, "sample_rate = 0").credit[0].sample_rate == 0.0
    for bad in ("1.5", "-0.1", "nan"):
        with pytest.raises(ConfigError, match=r"credit\[0\].sample_rate must be within \[0, 1\]"):
            _config_with(tmp_path, f"sample_rate = {bad}")


# -- the span reader -------------------------------------------------------------------------------------------------

def span(index: int, attributes: dict[str, str]) -> dict:
    return {"span_id": f"s{index}", "rollout_id": "r", "attempt_id": "a", "name": "chat", "kind": "LLM",
            "start_time_us": index, "end_time_us": index + 1, "status": "OK", "attributes": attributes,
            "model": "m", "prompt_token_ids": [1, 2], "response_token_ids": [3], "response_logprobs": [-0.5]}


def read(attributes_list: list[dict[str, str]]) -> list[SpanNode]:
    record = CODEC.encode_span_batch([span(i, a) for i, a in enumerate(attributes_list)])
    _, _, schema = CODEC.writer_schema(record)
    return SpanReader(schema, SpanNode).batch(record[5:])


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
def test_reader_picks_the_train_flag_from_the_attributes_map(attributes, expected):
    [node] = read([attributes])
    assert node.train is expected
    assert node.span_id == "s0" and node.has_token_ids and node.model == "m", "the fields after the map still read"


def test_reader_flags_differ_per_span_and_the_rest_of_the_batch_reads_on():
    nodes = read([{TRAIN_ATTRIBUTE: "true"}, {}, {TRAIN_ATTRIBUTE: "false", "x": "y"}, {SAME_LENGTH: "true"}])
    assert [n.train for n in nodes] == [True, None, False, None]
    assert [n.span_id for n in nodes] == ["s0", "s1", "s2", "s3"]


def test_a_flag_value_that_is_not_text_never_raises():
    record = bytearray(CODEC.encode_span_batch([span(0, {TRAIN_ATTRIBUTE: "XXXX", "other": "YYYY"})]))
    for marker in (b"XXXX", b"YYYY"):
        at = record.index(marker)
        record[at:at + 4] = b"\xff\xfe\x00\x80"  # not UTF-8: nothing in the map is decoded
    _, _, schema = CODEC.writer_schema(bytes(record))
    [node] = SpanReader(schema, SpanNode).batch(bytes(record[5:]))
    assert node.train is None and node.span_id == "s0"


def test_reader_finds_the_flag_in_blocks_written_with_byte_sizes():
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
    [node] = SpanReader(schema, SpanNode).rows(1, row)
    assert node.train is False and node.span_id == "s1"


def test_a_schema_without_attributes_reads_no_flag():
    schema = fastavro.parse_schema({"type": "record", "name": "row", "fields": [
        {"name": "span_id", "type": "string"}, {"name": "attempt_id", "type": "string"},
        {"name": "name", "type": "string"}, {"name": "kind", "type": "string"},
        {"name": "start_time_us", "type": "long"}, {"name": "end_time_us", "type": "long"}]})
    [node] = SpanReader(schema, SpanNode).rows(1, b"\x04s1\x04a1\x02n\x06LLM\x02\x04")
    assert node.train is None


def test_the_stored_spans_query_brings_back_the_flag():
    assert "mapFilter((k, v) -> k = 'agentstream.train', attributes) AS attributes" in STORED_SPANS_SQL


# -- the decision ----------------------------------------------------------------------------------------------------

def trajectory(rollout_id: str, flags: tuple[bool | None, ...] = (None,), group: str = "") -> object:
    spans = [SpanNode(span_id=f"{rollout_id}-{i}", parent_id="", kind="LLM", name="chat", start_us=i, end_us=i + 1,
                      attempt_id="a", agent_name="agent", group_id=group, model="m", has_token_ids=True, train=flag)
             for i, flag in enumerate(flags)]
    spans.append(SpanNode(span_id=f"{rollout_id}-r", parent_id="", kind="REWARD", name="reward", start_us=99,
                          end_us=99, attempt_id="a", agent_name="agent", group_id=group, reward=1.0))
    return assemble(rollout_id, spans, "SUCCEEDED", "a")


def test_explicit_flags_win_over_the_rule_and_opt_out_wins_over_opt_in():
    never, always = CreditRule(sample_rate=0.0), CreditRule(sample_rate=1.0)
    assert training_choice(trajectory("r", (False,)), always) == "opted_out"
    assert training_choice(trajectory("r", (True, None, False)), always) == "opted_out"
    assert training_choice(trajectory("r", (None, True)), never) == "opted_in"
    assert training_choice(trajectory("r", (None, None)), never) == "sampled_out"
    assert training_choice(trajectory("r", (None,)), always) == "sampled"


def test_no_rule_or_a_rule_that_does_not_train_never_trains_even_when_opted_in():
    assert training_choice(trajectory("r", (True,)), None) == "not_trained"
    assert training_choice(trajectory("r", (True,)), CreditRule(train=False)) == "not_trained"
    assert training_choice(trajectory("r"), CreditRule(train=False)) == "not_trained"


def test_sampling_rate_zero_one_and_half():
    ids = [f"rollout-{i}" for i in range(4000)]
    for rate, expected in ((0.0, 0), (1.0, len(ids))):
        assert sum(training_choice(trajectory(i), CreditRule(sample_rate=rate)) == "sampled" for i in ids) == expected
    half = [training_choice(trajectory(i), CreditRule(sample_rate=0.5)) for i in ids]
    assert set(half) == {"sampled", "sampled_out"}
    assert 0.46 < half.count("sampled") / len(ids) < 0.54
    tenth = sum(training_choice(trajectory(i), CreditRule(sample_rate=0.1)) == "sampled" for i in ids)
    assert 0.08 < tenth / len(ids) < 0.12
    rng = random.Random(5)
    uuid_like = [f"{rng.getrandbits(128):032x}" for _ in range(4000)]  # the SDK's ids are uuid4 hex
    assert 0.46 < sum(sample_point(i) < 0.5 for i in uuid_like) / len(uuid_like) < 0.54


def test_sampling_is_deterministic_and_stable_across_processes():
    rule = CreditRule(sample_rate=0.5)
    first = [training_choice(trajectory(f"d-{i}"), rule) for i in range(200)]
    assert first == [training_choice(trajectory(f"d-{i}"), rule) for i in range(200)]
    assert all(0.0 <= sample_point(f"d-{i}") < 1.0 for i in range(200))
    # a fixed hash (blake2b), not Python's salted hash(): every worker and every replay decides the same
    assert sample_point("rollout-1") == pytest.approx(0.8513806679, abs=1e-9)


def test_a_group_is_sampled_whole_by_its_group_id():
    rule = CreditRule(strategy="grpo", sample_rate=0.5)
    outcomes = set()
    for group in range(200):
        choices = {training_choice(trajectory(f"g{group}-m{member}", group=f"g{group}"), rule) for member in range(8)}
        assert len(choices) == 1, f"group g{group} was split: {choices}"
        outcomes |= choices
        assert choices == {"sampled" if sample_point(f"g{group}") < 0.5 else "sampled_out"}
    assert outcomes == {"sampled", "sampled_out"}

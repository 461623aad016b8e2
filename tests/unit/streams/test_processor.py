"""The span processor's training choice per rollout (explicit opt-out, opt-in, then deterministic sampling) and the
stored spans query that brings the train flag back."""

from __future__ import annotations

import asyncio
import random

import pytest

from agentstream.infra.config import CreditRule, load_config
from agentstream.schemas import AvroCodec
from agentstream.streams.processor import STORED_SPANS_SQL, SpanProcessor, sample_point, training_choice
from agentstream.streams.trajectory import SpanNode, assemble
from tests.support.streams_fakes import Held, Sent


def test_the_stored_spans_query_brings_back_the_flag():
    assert "mapFilter((k, v) -> k = 'agentstream.train', attributes) AS attributes" in STORED_SPANS_SQL


def test_expired_rollouts_stay_closed_for_two_expiries_as_restore_reads_them_then_are_forgotten():
    config = load_config(environ={})
    expiry = config.streams.reward_expiry_s
    now = [0.0]
    processor = SpanProcessor(config, None, None, Sent(), Held(), None, AvroCodec(),  # type: ignore[arg-type]
                              clock=lambda: now[0])
    processor.closed.update({"old": 0.0, "newer": expiry})
    now[0] = 2 * expiry + 1
    asyncio.run(processor.tick())
    assert list(processor.closed) == ["newer"]
    now[0] = 3 * expiry + 1
    asyncio.run(processor.tick())
    assert processor.closed == {}


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

"""Rewards are finite numbers at every entry: resolve_reward, ags.emit_reward, Agent Lightning, OTLP spans."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

import agentstream as ags
import agentstream.agl as agl
from agentstream.pipeline import sdk
from agentstream.pipeline.collector.mapping import TraceMapper
from agentstream.pipeline.runner.agl import forward_span
from agentstream.schemas.contracts import RewardError, resolve_reward
from tests.support.sinks import ListSink

# (value, what the error says): everything a JSON body, a Python agent or a careless client can send
HOSTILE = [
    (float("nan"), "finite"),
    (float("inf"), "finite"),
    (float("-inf"), "finite"),
    (json.loads("1e309"), "finite"),  # a JSON number beyond the float range parses as Infinity
    (json.loads("NaN"), "finite"),  # Python's json (and so aiohttp's request.json) reads the NaN literal
    (10 ** 400, "beyond the range of a float"),
    (-(10 ** 400), "beyond the range of a float"),
    ("nan", "not a string"),
    ("inf", "not a string"),
    ("1.0", "not a string"),  # a reward is a JSON number: a numeric string is refused, not guessed at
    (True, "not bool"),
    (False, "not bool"),
    ([1.0], "not list"),
    ({"value": 1.0}, "not dict"),
    (np.float64("nan"), "finite"),
    (np.float32("inf"), "finite"),
]


@pytest.mark.parametrize(("value", "says"), HOSTILE)
def test_resolve_reward_refuses_what_is_not_a_finite_number(value, says):
    with pytest.raises(RewardError, match=says):
        resolve_reward(value)
    with pytest.raises(RewardError, match=rf"reward dimension 'speed' .*{says}"):
        resolve_reward(dimensions={"accuracy": 1.0, "speed": value})
    with pytest.raises(RewardError, match=says):
        resolve_reward(value, dimensions={"accuracy": 1.0})


@pytest.mark.parametrize(("value", "expected"), [
    (1, 1.0), (0.25, 0.25), (-3, -3.0), (0, 0.0), (1e308, 1e308), (-1e308, -1e308), (np.float32(0.5), 0.5),
    (np.int64(2), 2.0), (Fraction(1, 4), 0.25), (10 ** 300, 1e300)])
def test_resolve_reward_takes_every_finite_real_number(value, expected):
    scalar, dimensions = resolve_reward(value)
    assert scalar == expected and type(scalar) is float and dimensions is None


def test_dimensions_sum_to_a_finite_scalar_or_are_refused():
    assert resolve_reward(dimensions={"a": 1, "b": 0.5}) == (1.5, {"a": 1.0, "b": 0.5})
    assert resolve_reward(dimensions={"a": 1, "b": 0.5}, primary="b") == (0.5, {"a": 1.0, "b": 0.5})
    with pytest.raises(RewardError, match="overflows"):
        resolve_reward(dimensions={"a": 1e308, "b": 1e308})
    assert resolve_reward(dimensions={"a": 1e308, "b": 1e308}, primary="a")[0] == 1e308  # a primary needs no sum
    with pytest.raises(RewardError, match="a string, not list"):
        resolve_reward(dimensions={"a": 1.0}, primary=["a"])  # type: ignore[arg-type]
    with pytest.raises(RewardError, match="not one of"):
        resolve_reward(dimensions={"a": 1.0}, primary="b")
    with pytest.raises(RewardError, match="map of names to numbers"):
        resolve_reward(dimensions=[1.0, 2.0])
    with pytest.raises(RewardError, match="needs a number"):
        resolve_reward()


@pytest.mark.parametrize(("value", "says"), [(v, s) for v, s in HOSTILE if not isinstance(v, dict)])  # dict: dimensions
def test_ags_emit_reward_refuses_and_records_nothing(value, says):
    sink = ListSink()
    with ags.rollout("agent", rollout_id="r-hostile", sink=sink) as state:
        with pytest.raises(RewardError, match=says):
            ags.emit_reward(value)
        with pytest.raises(RewardError, match=says):
            ags.emit_reward({"accuracy": 1.0, "speed": value}, primary="accuracy")
        ags.emit_reward(0.5)
    assert [span["reward"] for span in sink.rewards()] == [0.5] and state.rewards == [0.5]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 10 ** 400])
def test_agent_lightning_emit_reward_refuses_even_when_not_propagated(value):
    sink = ListSink()
    with sdk.rollout("agent", rollout_id="r-agl", sink=sink):
        for propagate in (True, False):
            with pytest.raises(RewardError, match=r"finite|range"):
                agl.emit_reward(value, propagate=propagate)
            with pytest.raises(RewardError, match=r"finite|range"):
                agl.emit_reward({"task": 1.0, "cost": value}, primary_key="task", propagate=propagate)
        with pytest.raises(TypeError, match="Reward must be a number"):  # Agent Lightning's own check comes first
            agl.emit_reward("nan")  # type: ignore[arg-type]
    assert sink.rewards() == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "nan", None])
def test_agent_lightning_reward_annotations_are_checked(value):
    sink = ListSink()
    with sdk.rollout("agent", rollout_id="r-annotation", sink=sink):
        with pytest.raises(RewardError):
            forward_span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                                       "agentlightning.reward.0.value": value})
        with pytest.raises(RewardError):
            forward_span("agentlightning.annotation", {
                "agentlightning.reward.0.name": "task", "agentlightning.reward.0.value": 1.0,
                "agentlightning.reward.1.name": "cost", "agentlightning.reward.1.value": value})
    assert sink.rewards() == []


def test_an_agent_returning_nan_fails_its_attempt_with_a_reward_error():
    from agentstream.pipeline.runner.pool import (
        emit_reward,  # the runner records a returned number through the SDK's check
    )

    sink = ListSink()
    with sdk.rollout("agent", rollout_id="r-return", sink=sink), pytest.raises(RewardError, match="finite"):
        emit_reward(float("nan"))
    assert sink.rewards() == []


# ------------------------------------------------------------------ OTLP


def kv(key: str, value) -> KeyValue:
    if isinstance(value, str):
        return KeyValue(key=key, value=AnyValue(string_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(double_value=value))


def export(*spans: tuple[str, dict, list[tuple[str, dict]]]) -> ExportTraceServiceRequest:
    """One trace: a root span 'agent' and the given (name, attributes, events) spans under it."""
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    root = scope.spans.add(trace_id=bytes(range(1, 17)), span_id=b"\x01" * 8, name="agent",
                           start_time_unix_nano=1_000_000, end_time_unix_nano=9_000_000)
    root.attributes.append(kv("gen_ai.operation.name", "invoke_agent"))
    for index, (name, attributes, events) in enumerate(spans, start=2):
        span = scope.spans.add(trace_id=bytes(range(1, 17)), span_id=bytes([index]) * 8, parent_span_id=b"\x01" * 8,
                               name=name, start_time_unix_nano=2_000_000, end_time_unix_nano=3_000_000)
        span.attributes.extend(kv(key, value) for key, value in attributes.items())
        for event_name, event_attributes in events:
            event = span.events.add(name=event_name, time_unix_nano=2_500_000)
            event.attributes.extend(kv(key, value) for key, value in event_attributes.items())
    return request


@pytest.mark.parametrize(("name", "attributes", "events", "says"), [
    ("reward", {"agentstream.reward": math.nan}, [], "agentstream.reward is nan"),
    ("reward", {"agentstream.reward": "inf"}, [], "agentstream.reward is inf"),
    ("reward", {"agentstream.reward": "1e309"}, [], "agentstream.reward is inf"),
    ("chat", {"gen_ai.operation.name": "chat", "agentstream.reward.speed": -math.inf}, [],
     "agentstream.reward.speed is -inf"),
    ("judge", {"gen_ai.operation.name": "evaluate", "gen_ai.evaluation.score.value": math.nan}, [],
     "gen_ai.evaluation.score.value is nan"),
    ("chat", {"gen_ai.operation.name": "chat"}, [("gen_ai.evaluation.result", {
        "gen_ai.evaluation.name": "relevance", "gen_ai.evaluation.score.value": math.inf})],
     "gen_ai.evaluation.score.value is inf"),
    ("chat", {"gen_ai.operation.name": "chat"}, [("reward", {"value": "nan"})], "value is nan"),
    ("annotation", {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": math.nan}, [],
     "agentlightning.reward.0.value is nan"),
    ("reward", {"agentstream.reward.a": 1e308, "agentstream.reward.b": 1e308}, [], "overflows"),
])
def test_an_otlp_span_with_a_non_finite_reward_is_refused_with_its_reason(name, attributes, events, says):
    mapped = TraceMapper().map(export((name, attributes, events), ("reward", {"agentstream.reward": 0.5}, [])), 1)
    (reason, refused), = mapped.rejected
    assert says in reason and reason.startswith(f"span {name!r}") and refused["name"] == name
    assert "finite" in reason or "overflows" in reason
    assert [span["reward"] for span in mapped.spans if span["kind"] == "REWARD"] == [0.5]  # the rest of it is taken
    assert refused["spanId"] == "02" * 8 and not any(span["span_id"].startswith("02" * 8) for span in mapped.spans)


def test_otlp_rewards_that_are_finite_or_not_numbers_are_taken_as_before():
    mapped = TraceMapper().map(export(("reward", {"agentstream.reward": "0.75"}, []),
                                      ("reward", {"note": "great"}, []),  # no number: kept as a plain span
                                      ("judge", {"gen_ai.operation.name": "evaluate",
                                                 "gen_ai.evaluation.score.value": 1e308}, [])), 1)
    assert mapped.rejected == []
    assert sorted(span["reward"] for span in mapped.spans if span["kind"] == "REWARD") == [0.75, 1e308]

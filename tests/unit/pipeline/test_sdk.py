"""The SDK: a rollout's train choice stamped on every span it builds; its proxy key is its API key, kept out of repr."""

from __future__ import annotations

import asyncio

import pytest

from agentstream.pipeline import sdk
from agentstream.pipeline.sdk import Rollout, build_span, rollout
from agentstream.schemas.contracts import TRAIN_ATTRIBUTE
from tests.support.sinks import ListSink


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


def test_a_rollouts_key_is_its_api_key_and_stays_out_of_its_repr():
    state = sdk.Rollout("r", "r-1", proxy_url="http://127.0.0.1:1", proxy_key="k-secret")
    assert state.llm_api_key() == "k-secret" and "k-secret" not in repr(state)
    assert sdk.Rollout("r", "r-1").llm_api_key() == sdk.UNUSED_API_KEY


def test_an_async_rollout_beats_while_open_and_never_after_its_end():
    """A model call slower than the stream processors' idle timeout must not read as a dead rollout."""
    sink = ListSink()

    async def handler() -> None:
        async with rollout("agent", sink=sink, heartbeat_s=0.02):
            await asyncio.sleep(0.15)  # a slow call
        await asyncio.sleep(0.1)  # a beat due now must not come after the end

    asyncio.run(handler())
    kinds = [event["event"] for event in sink.events]
    assert kinds[0] == "STARTED" and kinds[-1] == "SUCCEEDED"
    assert set(kinds[1:-1]) == {"HEARTBEAT"} and len(kinds) - 2 >= 3


def test_a_rollout_entered_outside_an_event_loop_sends_no_heartbeat():
    sink = ListSink()
    with rollout("agent", sink=sink, heartbeat_s=0.01):
        pass
    assert [event["event"] for event in sink.events] == ["STARTED", "SUCCEEDED"]


def test_a_stopped_heartbeat_sends_nothing_more_and_no_end():
    """What a cancelled runner does with its attempt: the task runs again elsewhere, this one falls silent."""
    sink = ListSink()

    async def cancelled() -> None:
        scope = rollout("agent", sink=sink, heartbeat_s=0.02)
        scope.__enter__()
        await asyncio.sleep(0.07)
        scope.stop_heartbeat()
        beats = len(sink.events)
        await asyncio.sleep(0.1)
        assert len(sink.events) == beats

    asyncio.run(cancelled())
    kinds = [event["event"] for event in sink.events]
    assert kinds[0] == "STARTED" and set(kinds[1:]) == {"HEARTBEAT"} and len(kinds) >= 3

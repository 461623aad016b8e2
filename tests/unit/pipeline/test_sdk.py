"""The SDK: a rollout's train choice stamped on every span it builds; its proxy key is its API key, kept out of repr."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from agentstream.pipeline import sdk
from agentstream.pipeline.sdk import Rollout, build_span, rollout
from agentstream.schemas.contracts import TRAIN_ATTRIBUTE
from tests.support.sinks import ListSink

PATIENCE_S = 10.0
"""How long a test waits for beats due every 0.02 s: a loaded CI machine may be that slow, an unloaded one
never is. Tests wait for the beats they need, not a fixed time, so a slow machine is slow, not red."""


def beats(sink: ListSink) -> int:
    return [event["event"] for event in sink.events].count("HEARTBEAT")


def wait_for_beats(sink: ListSink, least: int) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while beats(sink) < least:
        assert time.monotonic() < deadline, f"{beats(sink)} of {least} beats in {PATIENCE_S:.0f} s"
        time.sleep(0.01)


async def beats_come(sink: ListSink, least: int) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while beats(sink) < least:
        assert time.monotonic() < deadline, f"{beats(sink)} of {least} beats in {PATIENCE_S:.0f} s"
        await asyncio.sleep(0.01)


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
            await beats_come(sink, 3)  # a slow call
        ended.append(len(sink.events))
        await asyncio.sleep(0.1)  # a beat due now must not come after the end

    ended: list[int] = []
    asyncio.run(handler())
    kinds = [event["event"] for event in sink.events]
    assert len(kinds) == ended[0] and kinds[0] == "STARTED" and kinds[-1] == "SUCCEEDED"
    assert set(kinds[1:-1]) == {"HEARTBEAT"} and len(kinds) - 2 >= 3


def test_rollouts_entered_outside_an_event_loop_beat_from_one_thread_each_on_its_own_and_never_after_its_end():
    """A synchronous handler (a WSGI server's thread) waiting on a slow model call is alive too."""
    sinks = [ListSink(), ListSink()]
    threads_before = threading.active_count()

    def handler(sink: ListSink, least: int) -> None:
        with rollout("agent", sink=sink, heartbeat_s=0.02):
            wait_for_beats(sink, least)  # a slow call

    handlers = [threading.Thread(target=handler, args=(sinks[0], 6)),
                threading.Thread(target=handler, args=(sinks[1], 3))]
    for thread in handlers:
        thread.start()
    for thread in handlers:
        thread.join()
    ended = [len(sink.events) for sink in sinks]
    time.sleep(0.1)  # beats due now must not come after the ends
    assert [len(sink.events) for sink in sinks] == ended
    for sink, least in zip(sinks, (6, 3), strict=True):
        kinds = [event["event"] for event in sink.events]
        assert kinds[0] == "STARTED" and kinds[-1] == "SUCCEEDED"
        assert set(kinds[1:-1]) == {"HEARTBEAT"} and len(kinds) - 2 >= least, kinds
        assert len({event["attempt_id"] for event in sink.events}) == 1
    assert threading.active_count() <= threads_before + 1  # the one heartbeat thread, whatever the scopes


def test_a_scope_whose_sink_fails_stops_beating_and_the_others_beat_on():
    class ClosedSink(ListSink):
        def publish_event(self, event: dict) -> None:
            if event["event"] == "HEARTBEAT":
                raise RuntimeError("publisher closed")
            super().publish_event(event)

    closed, sink = ClosedSink(), ListSink()
    with rollout("agent", sink=closed, heartbeat_s=0.02), rollout("agent", sink=sink, heartbeat_s=0.02):
        wait_for_beats(sink, 3)  # each beat of the other scope's came with one of the closed sink's, refused
    assert [event["event"] for event in closed.events] == ["STARTED", "SUCCEEDED"]


def test_a_heartbeat_of_0_sends_none():
    sink = ListSink()

    async def handler() -> None:
        async with rollout("agent", sink=sink, heartbeat_s=0):
            await asyncio.sleep(0.05)

    asyncio.run(handler())
    with rollout("agent", sink=sink, heartbeat_s=0):
        time.sleep(0.05)
    assert [event["event"] for event in sink.events] == ["STARTED", "SUCCEEDED"] * 2


@pytest.mark.parametrize("on_a_loop", [True, False])
def test_an_abandoned_scope_sends_nothing_more_no_end_and_is_no_longer_open(on_a_loop):
    """What a cancelled runner does with its attempt: the task runs again elsewhere, this one falls silent. Left
    open, it was the process's "only open rollout" that spans emitted outside any rollout went to."""
    sink = ListSink()
    scope = rollout("agent", sink=sink, heartbeat_s=0.02)
    beats_at_abandon = []

    def abandon() -> None:
        scope.abandon()
        assert sdk.current_rollout() is None
        beats_at_abandon.append(len(sink.events))

    async def on_loop() -> None:
        scope.__enter__()
        await beats_come(sink, 2)
        abandon()
        await asyncio.sleep(0.1)

    if on_a_loop:
        asyncio.run(on_loop())
    else:
        scope.__enter__()
        wait_for_beats(sink, 2)
        abandon()
        time.sleep(0.1)
    assert len(sink.events) == beats_at_abandon[0]
    kinds = [event["event"] for event in sink.events]
    assert kinds[0] == "STARTED" and set(kinds[1:]) == {"HEARTBEAT"} and len(kinds) >= 3


def test_a_forked_worker_beats_from_its_own_thread():
    """A pre-forking server (gunicorn) forks workers from a process whose heartbeat thread does not follow them."""
    with rollout("agent", sink=ListSink(), heartbeat_s=0.02):
        pass  # the parent's heartbeat thread is running
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        sink = ListSink()
        with rollout("agent", sink=sink, heartbeat_s=0.02):  # no wait_for_beats: an assert here would skip _exit
            deadline = time.monotonic() + PATIENCE_S
            while beats(sink) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        os.write(write, str(beats(sink)).encode())
        os._exit(0)
    os.close(write)
    sent = os.read(read, 16)
    os.waitpid(child, 0)
    assert int(sent) >= 2

"""The rollout tracker: a rollout completes on its end event plus the grace, or on the idle timeout."""

from __future__ import annotations

from agentstream.streams.lifecycle import RolloutTracker
from agentstream.streams.records import RawRecord
from tests.support.streams_fakes import node


def test_lifecycle_completes_on_end_event_plus_grace_or_idle_timeout():
    tracker = RolloutTracker(grace_s=1.0, idle_timeout_s=10.0)
    record = RawRecord("t", 0, 0, b"k", b"")
    assert tracker.on_event({"rollout_id": "a", "attempt_id": "a1", "event": "STARTED"}, record, 0.0) is True
    first, second = node("s1", "LLM", 10, 20), node("s2", "LLM", 20, 30)
    assert tracker.on_spans("a", record, 1.0, [first]) is False, "only the first record of a rollout is held"
    assert tracker.on_spans("b", record, 1.0, []) is True
    tracker.on_spans("a", record, 1.5, [second])
    tracker.on_event({"rollout_id": "a", "attempt_id": "a1", "event": "SUCCEEDED"}, record, 2.0)
    assert tracker.pop_due(2.5) == []
    done = tracker.pop_due(3.0)
    assert [r.rollout_id for r in done] == ["a"] and done[0].spans == [first, second]
    assert done[0].seen_from_start, "opened by its STARTED event: every span it has is in memory"
    assert tracker.pop_due(10.9) == []
    [late] = tracker.pop_due(11.0)
    assert late.rollout_id == "b" and not late.seen_from_start, "opened by a span: earlier ones may be missing"

"""Trajectory assembly: orphans reattached by their time envelope, attempts kept apart."""

from __future__ import annotations

from agentstream.streams.trajectory import assemble
from tests.support.streams_fakes import node


def test_orphans_are_reattached_by_time_envelope_and_attempts_are_separated():
    spans = [
        node("root", "AGENT", 0, 100), node("tool", "TOOL", 10, 40, "root"),
        node("orphan", "LLM", 20, 30, parent="missing-parent"),
        node("proxy-llm", "LLM", 50, 60),  # no parent at all: a root of its own
        node("old", "LLM", 0, 5, attempt="a0"),
    ]
    built = assemble("ro", spans, "SUCCEEDED", "a1")
    by_id = {s.span_id: s for s in built.spans}
    assert [c.span_id for c in by_id["tool"].children] == ["orphan"]
    assert sorted(r.span_id for r in built.roots) == ["proxy-llm", "root"]
    assert "old" not in by_id, "spans of another attempt are not part of this trajectory"
    assert assemble("ro", spans, "COMPLETED").attempt_id == "a1", "without a terminal event: the latest attempt"

"""Rollout lifecycle state: which rollouts are open, when each one is complete, and which offsets it holds.

The state is derived from the spans topic alone and is rebuilt by replay after a crash: each
open rollout keeps the spans it received (token arrays still Avro-encoded), and the
first record of every open rollout is held (not acknowledged), so the committed offset never
passes a rollout that has not been written out. Rollouts that wait hours for a late reward
are persisted in ClickHouse (status AWAITING_REWARD) instead, so they do not hold offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentstream.schemas.records import RolloutEventRecord
from agentstream.streams.records import RawRecord
from agentstream.streams.trajectory import SpanNode

TERMINAL = {"SUCCEEDED", "FAILED", "TIMED_OUT", "CANCELLED"}


@dataclass
class OpenRollout:
    """An open rollout: the spans received so far, attribution and timing."""

    rollout_id: str
    held: RawRecord
    first_seen_s: float
    last_activity_s: float
    attempt_id: str | None = None
    terminal: str | None = None
    terminal_at_s: float | None = None
    error: str | None = None
    managed: bool = False  # a runner or SDK rollout (it sent STARTED): silence means it died
    seen_from_start: bool = False  # opened by its STARTED event: ``spans`` holds every span it has
    spans: list[SpanNode] = field(default_factory=list)

    def due_at(self, grace_s: float, idle_timeout_s: float) -> float:
        """When it completes: grace after its end event, else after a silence of idle_timeout_s."""
        if self.terminal_at_s is not None:
            return self.terminal_at_s + grace_s
        return self.last_activity_s + idle_timeout_s


class RolloutTracker:
    """Open rollouts by id, fed by span batches and rollout events, asked for the ones that are due."""

    def __init__(self, grace_s: float, idle_timeout_s: float) -> None:
        self.grace_s = grace_s
        self.idle_timeout_s = idle_timeout_s
        self.open: dict[str, OpenRollout] = {}
        self.next_due_s = float("inf")  # no open rollout is due before this (a due time only moves later)

    def _touch(self, rollout_id: str, record: RawRecord, now_s: float) -> tuple[OpenRollout, bool]:
        """The open rollout (opened now if new) and whether this record is the one it holds."""
        found = self.open.get(rollout_id)
        if found is None:
            found = self.open[rollout_id] = OpenRollout(rollout_id, record, now_s, now_s)
            self.next_due_s = min(self.next_due_s, now_s + self.idle_timeout_s)
            return found, True
        found.last_activity_s = now_s
        return found, False

    def on_spans(self, rollout_id: str, record: RawRecord, now_s: float, spans: list[SpanNode]) -> bool:
        """Add a record's spans; True when the caller must hold this record's offset."""
        rollout, holds = self._touch(rollout_id, record, now_s)
        rollout.spans.extend(spans)
        return holds

    def on_event(self, event: RolloutEventRecord, record: RawRecord, now_s: float) -> bool:
        """Apply a RolloutEvent; True when the caller must hold this record's offset."""
        rollout, holds = self._touch(event["rollout_id"], record, now_s)
        kind = event["event"]
        if kind == "STARTED":
            rollout.managed = True
            rollout.seen_from_start = rollout.seen_from_start or holds
            if rollout.attempt_id not in (None, event["attempt_id"]) and rollout.terminal is not None:
                # a retry started before the previous attempt was written out: restart the clock
                rollout.terminal = rollout.terminal_at_s = rollout.error = None
            rollout.attempt_id = event["attempt_id"]
        elif kind == "HEARTBEAT":
            rollout.managed = True
        elif kind in TERMINAL:
            rollout.managed = True
            rollout.attempt_id = event["attempt_id"]
            rollout.terminal = kind
            rollout.terminal_at_s = now_s
            rollout.error = event.get("error")
            self.next_due_s = min(self.next_due_s, now_s + self.grace_s)
        return holds

    def pop_due(self, now_s: float) -> list[OpenRollout]:
        """Remove and return the rollouts due by ``now_s``; cheap when none can be (ticks come every 20 ms)."""
        if now_s < self.next_due_s:
            return []
        due, self.next_due_s = [], float("inf")
        for rollout in list(self.open.values()):
            due_at = rollout.due_at(self.grace_s, self.idle_timeout_s)
            if due_at <= now_s:
                due.append(rollout)
                del self.open[rollout.rollout_id]
            else:
                self.next_due_s = min(self.next_due_s, due_at)
        return due

"""Transition identity: deterministic ids, so replays after a crash are harmless."""

from __future__ import annotations

import hashlib


def transition_id(rollout_id: str, attempt_id: str, span_id: str) -> str:
    """Same call, same id: a replay after a crash produces the same transition, which ClickHouse and the trainer dedupe."""
    return hashlib.sha1(f"{rollout_id}/{attempt_id}/{span_id}".encode()).hexdigest()[:32]

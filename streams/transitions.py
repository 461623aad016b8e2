"""Transition identity and storage layout: deterministic ids and the ClickHouse column list."""

from __future__ import annotations

import hashlib

TRANSITION_COLUMNS = (
    "transition_id", "rollout_id", "span_id", "agent_name", "model", "policy_version", "step_index", "group_id",
    "prompt_token_ids", "response_token_ids", "behaviour_logprobs", "reward", "return_value", "advantage",
    "created_at",
)


def transition_id(rollout_id: str, attempt_id: str, span_id: str) -> str:
    """Same call, same id: a replay after a crash produces the same transition, which ClickHouse and the trainer dedupe."""
    return hashlib.sha1(f"{rollout_id}/{attempt_id}/{span_id}".encode()).hexdigest()[:32]

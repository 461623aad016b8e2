"""Transitions from credited LLM calls: deterministic ids, token arrays read back from ClickHouse, rows and records."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from streams.credit import Credit
from streams.trajectory import Trajectory

TRANSITION_COLUMNS = (
    "transition_id", "rollout_id", "span_id", "agent_name", "model", "policy_version", "step_index", "group_id",
    "prompt_token_ids", "response_token_ids", "behaviour_logprobs", "reward", "return_value", "advantage",
    "created_at",
)


def transition_id(rollout_id: str, attempt_id: str, span_id: str) -> str:
    """Same call, same id: a replay after a crash produces the same transition, which ClickHouse and the trainer dedupe."""
    return hashlib.sha1(f"{rollout_id}/{attempt_id}/{span_id}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class TokenArrays:
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]


def transition_record(trajectory: Trajectory, credit: Credit, tokens: TokenArrays, trained_model: str,
                      created_at_us: int) -> dict[str, Any]:
    """A Transition (schemas/avro/transition.avsc) for one credited call."""
    call = credit.call
    return {
        "transition_id": transition_id(trajectory.rollout_id, trajectory.attempt_id, call.span_id),
        "rollout_id": trajectory.rollout_id,
        "span_id": call.span_id,
        "agent_name": trajectory.agent_name,
        "model": trained_model,
        "policy_version": call.policy_version or 0,
        "step_index": credit.step_index,
        "prompt_token_ids": tokens.prompt_token_ids,
        "response_token_ids": tokens.response_token_ids,
        "behaviour_logprobs": tokens.logprobs,
        "reward": credit.reward,
        "return_value": credit.return_value,
        "advantage": credit.advantage,
        "group_id": trajectory.group_id or None,
        "created_at_us": created_at_us,
    }


def transition_row(record: dict[str, Any]) -> tuple:
    import datetime

    created = datetime.datetime.fromtimestamp(record["created_at_us"] / 1e6, tz=datetime.timezone.utc)
    return (
        record["transition_id"], record["rollout_id"], record["span_id"], record["agent_name"], record["model"],
        record["policy_version"], record["step_index"], record["group_id"] or "", record["prompt_token_ids"],
        record["response_token_ids"], record["behaviour_logprobs"], record["reward"], record["return_value"],
        record["advantage"], created,
    )

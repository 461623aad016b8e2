"""Decoded Avro records as ClickHouse rows: the column lists and the field mapping for each table."""

from __future__ import annotations

import datetime
from typing import Any

SPAN_COLUMNS = (
    "span_id", "rollout_id", "attempt_id", "parent_id", "name", "kind", "start_time", "end_time", "status",
    "status_message", "agent_name", "task_id", "group_id", "model", "policy_version", "attributes",
    "prompt_token_ids", "response_token_ids", "response_logprobs", "reward", "reward_dimensions",
)

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def _time(value: datetime.datetime | int) -> datetime.datetime:
    """Avro timestamp-micros arrive as datetimes from fastavro, or as raw microseconds."""
    if isinstance(value, datetime.datetime):
        return value
    return _EPOCH + datetime.timedelta(microseconds=value)


def span_row(span: dict[str, Any]) -> tuple:
    """One ``spans`` row; absent optional fields become the column's empty value, not NULL, except where NULL means 'none'."""
    return (
        span["span_id"],
        span["rollout_id"],
        span["attempt_id"],
        span.get("parent_id") or "",
        span["name"],
        span["kind"],
        _time(span["start_time_us"]),
        _time(span["end_time_us"]),
        span.get("status", "UNSET"),
        span.get("status_message") or "",
        span.get("agent_name") or "",
        span.get("task_id") or "",
        span.get("group_id") or "",
        span.get("model") or "",
        span.get("policy_version"),
        span.get("attributes") or {},
        span.get("prompt_token_ids") or [],
        span.get("response_token_ids") or [],
        span.get("response_logprobs") or [],
        span.get("reward"),
        span.get("reward_dimensions") or {},
    )

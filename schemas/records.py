"""The records that travel as plain dicts, typed: a Span (``schemas/avro/span.avsc``), a RolloutEvent and a Task.

Spans are made by the SDK, the LLM proxy and the OTLP collector, and written by the publisher
(``schemas/span_writer.py``) in the caller's thread: tens of thousands a second. A
``TypedDict`` is a plain dict at run time, so typing them costs nothing on that path (no
object to build, no copy, no check); mypy checks every producer against the fields.
A key marked ``NotRequired`` has a default in the Avro schema; a test checks these
definitions against the schemas, so the two cannot drift apart. There is no
``from __future__ import annotations`` here: with it, Python 3.11 cannot see ``NotRequired``
and counts every key as required.
"""

from collections.abc import Mapping
from typing import NotRequired, TypedDict


class SpanRecord(TypedDict):
    """One Span record, as producers hand it to the publisher (fields in the schema's order)."""

    span_id: str
    rollout_id: str  # also the Kafka record key
    attempt_id: str
    parent_id: NotRequired[str | None]
    name: str
    kind: str  # a SpanKind symbol: LLM, TOOL, REWARD, MESSAGE, EXCEPTION, OBJECT, AGENT, ROLLOUT or OTHER
    start_time_us: int
    end_time_us: int
    status: NotRequired[str]  # a StatusCode symbol: UNSET (the default), OK or ERROR
    status_message: NotRequired[str | None]
    agent_name: NotRequired[str | None]
    task_id: NotRequired[str | None]
    group_id: NotRequired[str | None]
    model: NotRequired[str | None]
    attributes: NotRequired[Mapping[str, str]]
    prompt_token_ids: NotRequired[list[int] | None]
    response_token_ids: NotRequired[list[int] | None]
    response_logprobs: NotRequired[list[float] | None]
    reward: NotRequired[float | None]
    reward_dimensions: NotRequired[Mapping[str, float] | None]
    policy_version: NotRequired[int | None]


class RolloutEventRecord(TypedDict):
    """One RolloutEvent record (``schemas/avro/rollout_event.avsc``): runners and the collector publish it on the
    spans topic, the stream processors read it."""

    rollout_id: str
    attempt_id: str
    event: str  # a RolloutEventType symbol: STARTED, HEARTBEAT, SUCCEEDED, FAILED, TIMED_OUT, CANCELLED, EXPIRED
    at_us: int
    worker_id: NotRequired[str | None]
    error: NotRequired[str | None]
    task_id: NotRequired[str | None]
    agent_name: NotRequired[str | None]


class TaskRecord(TypedDict):
    """One Task record (``schemas/avro/task.avsc``): ``agentstream.pipeline.runner.tasks`` puts it on the tasks topic, a
    runner runs it."""

    task_id: str
    rollout_id: str  # also the Kafka record key
    group_id: NotRequired[str | None]
    agent_name: NotRequired[str | None]
    input: str  # the payload handed to the agent, as a JSON document
    attempt: NotRequired[int]
    max_attempts: NotRequired[int]
    timeout_s: float
    enqueued_at_us: int
    metadata: NotRequired[Mapping[str, str]]

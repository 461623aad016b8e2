"""agentstream: reinforcement learning for any AI agent, as an event stream over Kafka and ClickHouse.

What an agent needs, in one import::

    import agentstream as ags

    with ags.rollout(agent="support-bot") as r:       # or let `agentstream run` open it
        with ags.span("plan", kind="AGENT"):
            ...
        ags.emit_reward(1.0)

LLM calls are captured by the proxy (``agentstream proxy``); a user's late feedback goes to
``ags.feedback_url(proxy_url, rollout_id, token)`` with the token the proxy returned (or
``ags.feedback_token(rollout_id)``); everything else is the CLI (``agentstream --help``).

Every error agentstream raises is an ``ags.AgentstreamError``; its ``retriable`` says whether
the same call, made again later, may succeed (a broker or server outage, a full buffer) or not
(bad input).
"""

from agentstream.infra.config import ConfigError
from agentstream.pipeline.proxy.feedback import feedback_token, feedback_url
from agentstream.pipeline.publisher import FlushTimeout, PublisherClosed, PublisherError, PublisherFull, SpanPublisher
from agentstream.pipeline.runner.errors import AgentLoadError
from agentstream.pipeline.runner.tasks import TaskFileError
from agentstream.pipeline.sdk import (
    NoRollout,
    NoSink,
    Rollout,
    TokenMismatch,
    current_rollout,
    emit_exception,
    emit_llm_call,
    emit_message,
    emit_object,
    emit_reward,
    rollout,
    set_sink,
    span,
)
from agentstream.schemas.contracts import RewardError
from agentstream.schemas.errors import AgentstreamError, CodecError, EncodeError

__all__ = [
    "AgentLoadError",
    "AgentstreamError",
    "CodecError",
    "ConfigError",
    "EncodeError",
    "FlushTimeout",
    "NoRollout",
    "NoSink",
    "PublisherClosed",
    "PublisherError",
    "PublisherFull",
    "RewardError",
    "Rollout",
    "SpanPublisher",
    "TaskFileError",
    "TokenMismatch",
    "current_rollout",
    "emit_exception",
    "emit_llm_call",
    "emit_message",
    "emit_object",
    "emit_reward",
    "feedback_token",
    "feedback_url",
    "rollout",
    "set_sink",
    "span",
]

"""Wire contracts between processes that are not Avro records: HTTP header names, reward bodies, error bodies.

Every process that writes or reads one of these imports it from here, so the two ends of a
contract cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

POLICY_VERSION_HEADER = "X-Policy-Version"
"""The model server's answer: which policy version generated this response (the dev server sends it; vLLM does not)."""
ROLLOUT_HEADER = "X-Agentstream-Rollout"
ATTEMPT_HEADER = "X-Agentstream-Attempt"
AGENT_HEADER = "X-Agentstream-Agent"
TASK_HEADER = "X-Agentstream-Task"
GROUP_HEADER = "X-Agentstream-Group"
VERSION_HEADER = "X-Agentstream-Version"
"""A proxy request's version pin (``7`` or ``v7``), the same as naming the model ``model@v7``."""
TRAIN_HEADER = "X-Agentstream-Train"
"""A proxy request's opt-in ("true") or opt-out ("false") of training; absent, the credit rules' sampling decides."""
TRAIN_ATTRIBUTE = "agentstream.train"
"""The span attribute that carries a rollout's training choice ("true" or "false") from the SDK and proxy to streams."""

TRAIN_TRUE = frozenset({"true", "1", "yes", "on"})
TRAIN_FALSE = frozenset({"false", "0", "no", "off"})


class TrainFlagError(ValueError):
    """A training flag (header or attribute) that is neither true/1/yes/on nor false/0/no/off."""


def parse_train_flag(value: str | None) -> bool | None:
    """The training choice a header or attribute value states: True, False, or None when it states none.

    Absent or empty means "no choice" (the credit rules' sample rate decides); the words are
    case-insensitive. Anything else raises :class:`TrainFlagError`, so a typo is refused at the
    edge instead of silently training (or dropping) a rollout.
    """
    if value is None:
        return None
    word = value.strip().lower()
    if not word:
        return None
    if word in TRAIN_TRUE:
        return True
    if word in TRAIN_FALSE:
        return False
    raise TrainFlagError(f"a training flag ({TRAIN_HEADER} header or {TRAIN_ATTRIBUTE} attribute) must be one of "
                         f"true, 1, yes, on, false, 0, no, off, or empty for no choice; got {value!r}")


class RewardError(ValueError):
    """A reward that is not a number, or dimensions that are not a map of numbers with the named primary."""


def policy_version(headers: Mapping[str, str]) -> int | None:
    """The policy version a response names in its headers, or None when it names none (or garbage)."""
    value = headers.get(POLICY_VERSION_HEADER)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def resolve_reward(reward: Any = None, dimensions: Any = None,
                   primary: str | None = None) -> tuple[float, dict[str, float] | None]:
    """The scalar reward and its named dimensions, from either a number or dimensions plus an optional primary.

    With dimensions, the scalar is ``reward`` when given, else the ``primary`` dimension, else
    the sum of all of them. The SDK's ``emit_reward`` and the proxy's reward endpoint share it.
    """
    try:
        if dimensions is None:
            if reward is None or isinstance(reward, bool):
                raise RewardError("a reward needs a number, or dimensions as a map of numbers")
            return float(reward), None
        if not isinstance(dimensions, Mapping):
            raise RewardError("reward dimensions must be a map of names to numbers")
        named = {str(name): float(value) for name, value in dimensions.items()}
        if primary is not None and primary not in named:
            raise RewardError(f"primary reward {primary!r} is not one of {sorted(named)}")
        if reward is not None:
            return float(reward), named
        return (named[primary] if primary is not None else sum(named.values())), named
    except (TypeError, ValueError) as error:
        if isinstance(error, RewardError):
            raise
        raise RewardError(f"a reward must be a number: {error}") from None


def openai_error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's (and vLLM's) error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}

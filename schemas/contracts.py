"""Wire contracts between processes that are not Avro records: HTTP header names, reward bodies, error bodies.

Every process that writes or reads one of these imports it from here, so the two ends of a
contract cannot drift apart.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from agentstream.schemas.errors import AgentstreamError

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


class TrainFlagError(AgentstreamError, ValueError):
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


class RewardError(AgentstreamError, ValueError):
    """A reward that is not a finite number, or dimensions that are not finite numbers with the named primary."""


def policy_version(headers: Mapping[str, str]) -> int | None:
    """The policy version a response names in its headers, or None when it names none (or garbage)."""
    value = headers.get(POLICY_VERSION_HEADER)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def reward_number(value: Any, what: str = "a reward") -> float:
    """``value`` as a finite float, or :class:`RewardError` saying what is wrong with it.

    A reward is a number (``int``, ``float``, or any ``numbers.Real`` such as a numpy scalar):
    not a bool, not a string (``"1.0"``, ``"nan"``: a JSON body sends a number, and a string
    that ``float()`` would take is refused rather than guessed at), and finite: NaN, ±Infinity
    and values beyond the float range (``1e309`` parses as Infinity; ``10**400`` overflows)
    would poison every mean and advantage computed from them.
    """
    if isinstance(value, str):
        raise RewardError(f"{what} must be a number, not a string ({value[:40]!r}): send a JSON number")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(f"{what} must be a number, not {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        raise RewardError(f"{what} is beyond the range of a float (an integer of {value.bit_length()} bits)"
                          if isinstance(value, int) else f"{what} is beyond the range of a float") from None
    if not math.isfinite(number):
        raise RewardError(f"{what} must be finite, got {number!r}")
    return number


def resolve_reward(reward: Any = None, dimensions: Any = None,
                   primary: str | None = None) -> tuple[float, dict[str, float] | None]:
    """The scalar reward and its named dimensions, from either a number or dimensions plus an optional primary.

    With dimensions, the scalar is ``reward`` when given, else the ``primary`` dimension, else
    the sum of all of them. Every value must be a finite number (see :func:`reward_number`), and
    so must the sum. The SDK's ``emit_reward``, the Agent Lightning surfaces and the proxy's
    reward and event endpoints share it.
    """
    if dimensions is None:
        if reward is None:
            raise RewardError("a reward needs a number, or dimensions as a map of numbers")
        return reward_number(reward), None
    if primary is not None and not isinstance(primary, str):
        raise RewardError(f"the primary reward names a dimension: a string, not {type(primary).__name__}")
    if not isinstance(dimensions, Mapping):
        raise RewardError(f"reward dimensions must be a map of names to numbers, not {type(dimensions).__name__}")
    named = {str(name): reward_number(value, f"reward dimension {str(name)[:80]!r}")
             for name, value in dimensions.items()}
    if primary is not None and primary not in named:
        raise RewardError(f"primary reward {primary!r} is not one of {sorted(named)}")
    if reward is not None:
        return reward_number(reward), named
    if primary is not None:
        return named[primary], named
    total = sum(named.values())
    if not math.isfinite(total):
        raise RewardError("the sum of the reward dimensions overflows a float: name a primary dimension")
    return total, named


def openai_error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's (and vLLM's) error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}

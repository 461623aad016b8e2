"""The one way a section states its checks: a line per rule, every failure the same ``ConfigError`` sentence.

A section's ``__post_init__`` names itself once and its rules one per line::

    check = Checks("kafka", self)
    check.one_of("idempotence", IDEMPOTENCE)
    check.at_least("fetch_max_wait_ms", 1)

The first rule that fails raises ``kafka.idempotence must be auto, on or off, got 'yes'``: where the value
lives, what it must be, what it was. A rule about several values at once says its own sentence (:meth:`that`).
A NaN passes no bound (every comparison with it is false, and each rule states what must hold).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from agentstream.infra.config.errors import ConfigError

_INTERVAL = re.compile(r"([\[(])\s*(-?[0-9.]+)\s*,\s*(-?[0-9.]+)\s*([\])])")


def spelled(allowed: Iterable[str]) -> str:
    """``("a", "b", "c")`` as ``a, b or c``: how a message lists the values a setting may take."""
    items = list(allowed)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


class Checks:
    """The checks of one section's values (``where`` is how messages name it: ``trainer``, ``credit[2]``)."""

    __slots__ = ("_section", "_where")

    def __init__(self, where: str, section: object) -> None:
        self._where = where
        self._section = section

    def must(self, key: str, ok: bool, requirement: str) -> None:
        """Unless ``ok``: ``<where>.<key> must <requirement>, got <value>`` (the rule every other one states)."""
        if not ok:
            raise ConfigError(f"{self._where}.{key} must {requirement}, got {self._value(key)!r}")

    def that(self, ok: bool, message: str) -> None:
        """Unless ``ok``: ``<where>.<message>``, for a rule about several values that says its own sentence."""
        if not ok:
            raise ConfigError(f"{self._where}.{message}")

    def one_of(self, key: str, allowed: Iterable[str]) -> None:
        allowed = tuple(allowed)
        self.must(key, self._value(key) in allowed, f"be {spelled(allowed)}")

    def at_least(self, key: str, low: float, note: str = "") -> None:
        """``>= low``; ``note`` follows the bound in the message (``" (0: never)"``)."""
        self.must(key, self._value(key) >= low, f"be >= {low}{note}")

    def above(self, key: str, low: float, note: str = "") -> None:
        """``> low``; ``note`` as for :meth:`at_least`."""
        self.must(key, self._value(key) > low, f"be > {low}{note}")

    def within(self, key: str, interval: str) -> None:
        """Within an interval written as the message shows it: ``"[0, 1]"``, ``"(0, 1]"``, ``"(0.5, 1)"``."""
        match = _INTERVAL.fullmatch(interval)
        if not match:
            raise ValueError(f"not an interval: {interval!r}")
        opening, low, high, closing = match.group(1), float(match.group(2)), float(match.group(3)), match.group(4)
        value = self._value(key)
        ok = (value > low if opening == "(" else value >= low) and (value < high if closing == ")" else value <= high)
        self.must(key, ok, f"be within {interval}")

    def finite(self, key: str) -> None:
        self.must(key, math.isfinite(self._value(key)), "be a finite number")

    def port(self, key: str, zero: str = "") -> None:
        """A TCP port (1-65535); with ``zero``, also 0, which means ``zero`` (``"any free port"``)."""
        low = 0 if zero else 1
        self.must(key, low <= self._value(key) < 65536,
                  f"be a TCP port (1-65535) or 0 ({zero})" if zero else "be a TCP port (1-65535)")

    def http_url(self, key: str) -> None:
        """Unset, or an ``http://`` or ``https://`` URL."""
        value = self._value(key)
        self.must(key, value is None or value.startswith(("http://", "https://")), "start with http:// or https://")

    def device(self, key: str) -> None:
        """A torch device the trainer and the model server take: ``auto``, ``cpu`` or ``cuda[:N]``."""
        value = self._value(key)
        self.must(key, value in ("auto", "cpu") or value.startswith("cuda"), "be auto, cpu or cuda[:N]")

    def _value(self, key: str) -> Any:
        return getattr(self._section, key)

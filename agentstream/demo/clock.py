"""RL's clock in a demo, and the watch that ends a budget in steps no version moves any more."""

from __future__ import annotations

import time


class TrainingClock:
    """RL's seconds: wall time since RL started, less the held-out evaluations run meanwhile.

    Evaluations are kept off the clock so that on a slower machine they do not eat the training
    budget: ``--seconds`` is what RL gets, whatever the machine.
    """

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.paused = 0.0  # seconds held, evaluations included
        self._held_since: float | None = None

    def elapsed(self) -> float:
        now = time.monotonic()
        holding = now - self._held_since if self._held_since is not None else 0.0
        return now - self.started - self.paused - holding

    def hold(self) -> None:
        """Stop the clock (an evaluation starts)."""
        self._held_since = time.monotonic()

    def release(self) -> None:
        """Start it again where it stopped."""
        if self._held_since is not None:
            self.paused += time.monotonic() - self._held_since
            self._held_since = None


class StallWatch:
    """Whether RL's policy version has stood still for ``limit_s`` seconds of its clock.

    A budget in steps waits for versions, and where none comes it would wait for ever: when every
    group a policy samples is flat (all failed), RL has nothing to train. The two-agent demo's
    calculator did that after a warm start that left its adapter at 0%. The demo ends such an agent's
    RL at the limit and says so; a budget in seconds ends on its own (``limit_s`` None: never stalls).
    """

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s
        self.stalled = False
        self._version: int | None = None
        self._since = 0.0

    def check(self, version: int, seconds: float) -> bool:
        """Whether the version, seen at ``seconds`` on RL's clock, has not moved for the limit; once true, stays."""
        if version != self._version:
            self._version, self._since = version, seconds
        if self.limit_s is not None and seconds - self._since >= self.limit_s:
            self.stalled = True
        return self.stalled

    def describe(self) -> str:
        """Why RL ended early, in words (for the console and the report's readers)."""
        return (f"no new policy version for {self.limit_s:.0f} s of RL (v{self._version} since "
                f"{self._since:.0f} s): its budget in steps ended unspent; every group it sampled was likely "
                "flat (all failed), so there was nothing to train")

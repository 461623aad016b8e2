"""Holes in a partition's offsets: read them again until their records appear, instead of reading past them.

tansu 0.6 with durable storage (``dynostore``) raises a partition's high watermark with one
conditional put, then writes the batch's object; a fetch lists the objects below the high
watermark. With two producers on one partition, batch A takes offsets 10-12 and batch B takes
13; if B's object is stored first, a fetch from 10 in between finds only B, and the consumer's
position moves to 14: A is never read, though its producer was told it is stored. `make chaos`
lost two acknowledged spans that way (docs/failure-model.md). The partitions this project reads
this way are not compacted and nothing writes transactions to them, so their offsets have no holes
on any broker: a record past a hole means the hole's records are on their way. The consumer goes
back to the hole's first offset and reads again, for up to ``patience_s``; a hole that stays that
long (a broker killed between its watermark and its write: nothing there was acknowledged) is
passed, with a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger("agentstream.gaps")


@dataclass
class _Hole:
    first: int  # the first missing offset
    seen_at: float


class GapGuard:
    """Per partition, the last offset read; says whether a record may be processed or its hole read again."""

    def __init__(self, component: str, patience_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.component, self.patience_s, self.clock = component, patience_s, clock
        self._last: dict[Hashable, int] = {}
        self._holes: dict[Hashable, _Hole] = {}
        self.holes_read_again = 0  # holes whose records appeared when read again
        self.holes_passed = 0  # holes given up on after patience_s

    def admit(self, partition: Hashable, offset: int, name: str = "") -> int | None:
        """None when the record at ``offset`` may be processed; else the offset to read ``partition`` from again.

        The first record after :meth:`forget` (an assignment, a seek) is always admitted.
        """
        last = self._last.get(partition)
        if last is not None and offset > last + 1:
            hole = self._holes.get(partition)
            if hole is None or hole.first != last + 1:
                hole = self._holes[partition] = _Hole(last + 1, self.clock())
                log.warning("%s: offsets %d-%d of %s are not readable yet, though %d is; reading them again",
                            self.component, last + 1, offset - 1, name or partition, offset)
            if self.clock() - hole.seen_at < self.patience_s:
                return last + 1
            log.warning("%s: offsets %d-%d of %s did not appear within %.0f s; reading on from %d (a broker that "
                        "died between taking those offsets and storing them: none was acknowledged)",
                        self.component, hole.first, offset - 1, name or partition, self.patience_s, offset)
            self.holes_passed += 1
            del self._holes[partition]
        elif partition in self._holes and offset == self._holes[partition].first:
            log.warning("%s: offset %d of %s appeared when read again", self.component, offset, name or partition)
            self.holes_read_again += 1
            del self._holes[partition]
        self._last[partition] = offset
        return None

    def last(self, partition: Hashable) -> int | None:
        """The last offset admitted from ``partition`` (None: none since it was forgotten)."""
        return self._last.get(partition)

    def expect(self, partition: Hashable, next_offset: int) -> None:
        """``partition`` is read from ``next_offset`` now (a seek): a first record past it follows a hole."""
        self._last[partition] = next_offset - 1
        hole = self._holes.get(partition)
        if hole is not None and hole.first != next_offset:
            del self._holes[partition]

    def forget(self, partition: Hashable) -> None:
        """``partition`` is read from elsewhere now (assigned, revoked, moved by a seek): no hole is known there."""
        self._last.pop(partition, None)
        self._holes.pop(partition, None)

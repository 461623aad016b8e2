"""Holes in a partition's offsets are read again, for a while, instead of read past (infra/gaps.py)."""

from __future__ import annotations

from agentstream.infra.gaps import GapGuard


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_contiguous_offsets_and_a_first_record_are_admitted():
    guard = GapGuard("test", patience_s=2.0, clock=Clock())
    assert [guard.admit("p", offset) for offset in (7, 8, 9)] == [None, None, None]
    assert guard.last("p") == 9


def test_a_record_past_a_hole_sends_the_partition_back_until_the_hole_is_read():
    clock = Clock()
    guard = GapGuard("test", patience_s=2.0, clock=clock)
    guard.admit("p", 9)
    assert guard.admit("p", 13) == 10  # 10-12 not readable yet
    guard.expect("p", 10)  # the consumer went back to 10
    clock.now = 0.5
    assert guard.admit("p", 13) == 10  # still not there: again
    guard.expect("p", 10)
    assert [guard.admit("p", offset) for offset in (10, 11, 12, 13)] == [None] * 4
    assert (guard.holes_read_again, guard.holes_passed) == (1, 0)


def test_a_hole_that_stays_past_the_patience_is_passed():
    clock = Clock()
    guard = GapGuard("test", patience_s=2.0, clock=clock)
    guard.admit("p", 9)
    assert guard.admit("p", 13) == 10
    guard.expect("p", 10)
    clock.now = 2.5
    assert guard.admit("p", 13) is None
    assert guard.admit("p", 14) is None
    assert (guard.holes_read_again, guard.holes_passed) == (0, 1)


def test_a_seek_elsewhere_or_a_forgotten_partition_knows_no_hole():
    guard = GapGuard("test", patience_s=2.0, clock=Clock())
    guard.admit("p", 9)
    assert guard.admit("p", 13) == 10
    guard.expect("p", 40)  # moved by a rebalance: the hole at 10 is another member's now
    assert guard.admit("p", 40) is None
    guard.forget("p")
    assert guard.admit("p", 100) is None
    assert guard.admit("q", 5) is None and guard.admit("q", 6) is None  # partitions are independent

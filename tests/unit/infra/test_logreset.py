"""LogWatch: when a consumer's position no longer lies in its partition's log (infra/logreset.py)."""

from __future__ import annotations

from agentstream.infra.logreset import LogWatch


def test_a_position_past_the_log_end_is_a_reset_only_once_it_stays_there():
    watch = LogWatch("worker", settle_s=2.0)
    watch.expect("spans", 0, 75)
    assert watch.fetched("spans", 0, 80, now=0.0) is None  # inside the log
    assert watch.fetched("spans", 0, 6, now=1.0) is None  # past the end: wait (the high watermark may trail)
    assert watch.fetched("spans", 0, 6, now=2.5) is None
    reset = watch.fetched("spans", 0, 6, now=3.1)
    assert reset is not None and (reset.position, reset.log_end) == (75, 6)
    assert "log reset on spans[0]: worker was at offset 75, the log now ends at 6" in reset.line()
    assert "policy: reprocess the partition from the start of its log" in reset.line()


def test_a_log_that_catches_up_within_the_wait_is_no_reset():
    watch = LogWatch("worker", settle_s=2.0)
    watch.expect("spans", 0, 75)
    assert watch.fetched("spans", 0, 74, now=0.0) is None
    assert watch.fetched("spans", 0, 75, now=1.0) is None  # caught up: the clock starts again
    assert watch.fetched("spans", 0, 74, now=2.5) is None
    assert watch.fetched("spans", 0, None, now=9.0) is None  # no fetch answer: nothing to judge


def test_records_from_below_the_expected_offset_are_a_reset_and_a_seek_of_our_own_is_not():
    watch = LogWatch("runner")
    assert watch.read("tasks", 1, 0, 9) is None
    assert watch.read("tasks", 1, 10, 12) is None
    reset = watch.read("tasks", 1, 0, 2, log_end=3)
    assert reset is not None and (reset.position, reset.log_end) == (13, 3) and "from offset 0" in reset.cause
    watch.expect("tasks", 1, 0)  # our own seek to the start
    assert watch.read("tasks", 1, 0, 5) is None
    watch.forget("tasks", 1)
    assert watch.read("tasks", 1, 0, 0) is None and watch.fetched("tasks", 2, 0) is None

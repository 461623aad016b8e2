"""The queue between publishing threads and the background loop: bounded memory, order, and flush accounting.

Callers append prepared spans and encoded rollout events with a sequence number each; the loop
takes them in waves, groups a wave's spans per rollout into SpanBatch records and, once the
records are acknowledged, journaled or dropped, settles them: that gives their buffer space
back to blocked callers and moves the sequence number every flush() waits for.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentstream.pipeline.publisher.errors import FlushTimeout, PublisherClosed
from agentstream.pipeline.publisher.journal import Record
from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.span_writer import PreparedSpan, SpanBatchEncoder

Item = tuple[int, str, PreparedSpan | bytes, int]
"""One queued publish call: sequence number, rollout id, prepared span (or encoded RolloutEvent), bytes.

A plain tuple, read by unpacking, for the reason a PreparedSpan is one (schemas/span_writer.py)."""

COUNTERS = ("spans_published", "events_published", "spans_journaled", "records_journaled",
            "records_replayed", "spans_replayed", "records_dropped", "journal_write_failures")
"""The names of the counters the loop keeps here, as in PublisherStats."""


@dataclass(slots=True)
class _Run:
    """Consecutive spans of one rollout that will become one SpanBatch record."""

    rollout_id: str
    first_seq: int
    spans: list[PreparedSpan] = field(default_factory=list)
    nbytes: int = 0


class Accumulator:
    """The thread-safe pending queue shared by the publishing threads and the loop, with the state both read.

    Everything here changes under one lock (and its condition, notified when buffer space is
    freed, spans are settled or the publisher closes), except the encoding lock, which the loop
    holds while it encodes a wave. The loop reads a few fields without the lock (the properties
    below): it only decides on them when to look again.
    """

    def __init__(self, topic: str, *, linger_s: float, wave_bytes: int, max_buffered: int,
                 max_spans_per_record: int, max_record_bytes: int) -> None:
        self.topic = topic
        self._linger_s = linger_s
        self._wave_bytes = wave_bytes
        self._max_buffered = max_buffered
        self._max_spans = max_spans_per_record
        self._max_record_bytes = max_record_bytes
        self._encoder = SpanBatchEncoder()

        # Held by the loop while it encodes a wave, and passed through by every publish() call: numpy
        # releases the GIL for each array operation, and without this a thread that keeps publishing
        # would take the GIL back every time and starve the encoding (a GIL convoy: 5 ms per operation).
        self._encoding = threading.Lock()

        # Shared with publishing threads, under _lock.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # buffer space freed, spans settled, closing
        self._pending: deque[Item] = deque()
        self._pending_bytes = 0
        self._first_pending_at = 0.0
        self._buffered = 0  # pending + taken but not yet acknowledged or journaled
        self._seq = 0  # of the last publish() call
        self._taken_seq = 0  # of the last item the loop has taken
        self._settled_seq = 0  # every call up to this one is acknowledged or journaled
        self._flush_seq = 0  # a flush() waits for this one
        self._closing = False
        self._failure: AgentstreamError | None = None  # why the loop stopped for good, raised to every later caller
        self._close_deadline = 0.0
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._wake_loop: Callable[[], object] | None = None  # set once the loop runs; None: not started

    # --- read by the loop without the lock -----------------------------------------------------

    @property
    def closing(self) -> bool:
        """True once close() was called or the loop stopped: no more publish calls are taken."""
        return self._closing

    @property
    def close_deadline(self) -> float:
        """The time.monotonic() by which close() wants everything acknowledged or journaled."""
        return self._close_deadline

    @property
    def has_pending(self) -> bool:
        """True while publish calls wait to be taken."""
        return bool(self._pending)

    @property
    def half_full(self) -> bool:
        """True when the queued items take half the buffer or more."""
        return self._pending_bytes >= self._max_buffered // 2

    @property
    def flush_waiting(self) -> bool:
        """True while a flush() waits for publish calls not settled yet."""
        return self._flush_seq > self._settled_seq

    @property
    def buffered(self) -> int:
        """Bytes queued or taken and not yet acknowledged, journaled or dropped."""
        return self._buffered

    # --- the callers' side ---------------------------------------------------------------------

    def enqueue(self, rollout_id: str, payload: PreparedSpan | bytes, nbytes: int) -> None:
        """Queue one item, waiting for buffer space while the buffer is full; raises PublisherClosed."""
        if self._encoding.locked():  # wait here while the loop encodes a wave (see __init__)
            with self._encoding:
                pass
        with self._lock:
            while self._buffered and self._buffered + nbytes > self._max_buffered and not self._closing:
                self._changed.wait()
            self._append(rollout_id, payload, nbytes)

    def try_enqueue(self, rollout_id: str, payload: PreparedSpan | bytes, nbytes: int) -> bool:
        """Queue one item if the buffer has room for it now; False (nothing queued) when it has not."""
        if self._encoding.locked():
            with self._encoding:
                pass
        with self._lock:
            if self._buffered and self._buffered + nbytes > self._max_buffered and not self._closing:
                return False
            self._append(rollout_id, payload, nbytes)
            return True

    def try_enqueue_all(self, items: Sequence[tuple[str, PreparedSpan | bytes, int]]) -> int:
        """Queue all of these (rollout id, payload, bytes) items in order if the buffer has room for them together now.

        Returns 0 when they were queued, else the buffered bytes that left no room (nothing queued):
        a server answers "retry later" with that rather than hold its caller.
        """
        needed = sum(nbytes for _, _, nbytes in items)
        if self._encoding.locked():
            with self._encoding:
                pass
        with self._lock:
            if self._buffered and self._buffered + needed > self._max_buffered and not self._closing:
                return self._buffered
            for rollout_id, payload, nbytes in items:
                self._append(rollout_id, payload, nbytes)
            return 0

    @property
    def max_buffered(self) -> int:
        """The most bytes that may wait for the broker before publish calls wait (or offers are refused)."""
        return self._max_buffered

    def request_flush(self) -> int | None:
        """Ask the loop to send what is queued now; the sequence number to wait for, or None if all is settled."""
        with self._lock:
            target = self._seq
            if self._settled_seq >= target:
                return None
            self._flush_seq = max(self._flush_seq, target)
            return target

    def wait_settled(self, target: int, deadline: float, timeout_s: float, running: Callable[[], bool]) -> None:
        """Wait until publish call `target` and those before it are settled, the loop stops, or `deadline` passes."""
        with self._lock:
            while self._settled_seq < target:
                left = deadline - time.monotonic()
                if not running():
                    raise self._failure or PublisherClosed("the publisher stopped before the flush finished")
                if left <= 0:
                    raise FlushTimeout(f"{target - self._settled_seq} publish calls not yet acknowledged or "
                                       f"journaled after {timeout_s:g}s")
                self._changed.wait(left)
            if self._failure is not None:  # settled into the journal by a publisher that stopped on a refusal
                raise self._failure

    def begin_close(self, timeout_s: float) -> bool:
        """Take no more publish calls and set the close deadline; True for the first call, which sets it."""
        with self._lock:
            first = not self._closing
            if first:
                self._closing = True
                self._close_deadline = time.monotonic() + timeout_s
            self._changed.notify_all()
        return first

    def snapshot(self, state_of: Callable[[bool], str]) -> tuple[dict[str, int], int, str]:
        """The counters, the buffered bytes and ``state_of(closing)``, all read under the lock."""
        with self._lock:
            return dict(self._counts), self._buffered, state_of(self._closing)

    def _append(self, rollout_id: str, payload: PreparedSpan | bytes, nbytes: int) -> None:
        """Queue one item; the caller holds the lock."""
        if self._failure is not None:
            raise self._failure
        if self._closing or self._wake_loop is None:
            raise PublisherClosed(f"span publisher for {self.topic} is {'closed' if self._closing else 'not started'}")
        self._seq += 1
        self._pending.append((self._seq, rollout_id, payload, nbytes))
        self._buffered += nbytes
        self._pending_bytes += nbytes
        if len(self._pending) == 1:
            self._first_pending_at = time.monotonic()
            self._wake_loop()
        elif self._pending_bytes >= self._wave_bytes > self._pending_bytes - nbytes:
            self._wake_loop()

    # --- the loop's side -----------------------------------------------------------------------

    def attach(self, wake_loop: Callable[[], object]) -> None:
        """The loop runs: take publish calls from now on, and call `wake_loop` (thread-safe) when a wave may be due."""
        self._wake_loop = wake_loop

    def refuse(self, *, wake_waiters: bool) -> None:
        """Take no more publish calls (the loop is stopping); `wake_waiters` also wakes blocked callers."""
        with self._lock:
            self._closing = True
            if wake_waiters:
                self._changed.notify_all()

    def fail(self, failure: AgentstreamError) -> None:
        """The loop stopped for good on ``failure`` (a refusal by the cluster): every later call raises it."""
        with self._lock:
            self._failure = failure
        self.refuse(wake_waiters=True)

    def until_wave_due(self) -> float | None:
        """Seconds until the linger of the oldest queued item ends (0 or less: a wave is due now); None: nothing queued.

        A wave is due at once when the publisher closes, a full wave is queued, or a flush waits.
        """
        with self._lock:
            if (self._closing or self._pending_bytes >= self._wave_bytes
                    or (self._pending and self._flush_seq > self._settled_seq)):
                return 0.0
            return self._first_pending_at + self._linger_s - time.monotonic() if self._pending else None

    def take(self, max_bytes: int | None) -> list[Item]:
        """The oldest queued items, up to `max_bytes` of them (at least one), or all when None."""
        with self._lock:
            if max_bytes is None or self._pending_bytes <= max_bytes:
                items, self._pending = list(self._pending), deque()
                self._pending_bytes = 0
            else:
                items, taken = [], 0
                while self._pending and taken < max_bytes:
                    item = self._pending.popleft()
                    items.append(item)
                    _, _, _, nbytes = item
                    taken += nbytes
                self._pending_bytes -= taken
            if items:
                self._taken_seq, _, _, _ = items[-1]
            return items

    def build_records(self, items: list[Item]) -> list[Record]:
        """Group queued spans per rollout into SpanBatch records, in order with the rollout's events."""
        order: list[_Run | Record] = []
        open_runs: dict[str, _Run] = {}
        for seq, rollout_id, payload, nbytes in items:
            if isinstance(payload, bytes):  # a RolloutEvent closes the rollout's run: later spans go after it
                open_runs.pop(rollout_id, None)
                order.append(Record(rollout_id.encode(), payload, 0, seq, nbytes))
                continue
            run = open_runs.get(rollout_id)
            if run is None or len(run.spans) >= self._max_spans or run.nbytes >= self._max_record_bytes:
                run = open_runs[rollout_id] = _Run(rollout_id, seq)
                order.append(run)
            run.spans.append(payload)
            run.nbytes += nbytes
        with self._encoding:
            values = iter(self._encoder.encode_batches([entry.spans for entry in order if isinstance(entry, _Run)]))
        return [entry if isinstance(entry, Record)
                else Record(entry.rollout_id.encode(), next(values), len(entry.spans), entry.first_seq, entry.nbytes)
                for entry in order]

    def settle(self, records: list[Record], carried: list[Record]) -> None:
        """Give back the buffer space of records acknowledged, journaled or dropped; wake waiters.

        Every publish call taken before the oldest one still `carried` over to the next wave is settled.
        """
        released = sum(r.nbytes for r in records)
        with self._lock:
            self._buffered -= released
            oldest_open = min((r.first_seq for r in carried if r.first_seq >= 0), default=self._taken_seq + 1)
            self._settled_seq = max(self._settled_seq, oldest_open - 1)
            self._changed.notify_all()

    def count(self, name: str, amount: int) -> None:
        """Add `amount` to one of the counters."""
        if amount:
            with self._lock:
                self._counts[name] += amount

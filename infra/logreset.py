"""Noticing that a partition's log no longer holds what a consumer read, so that nothing is skipped silently.

A log can lose its head: a broker with in-memory storage restarts (every topic starts again at
offset 0), a user's broker is wiped, a topic is deleted and recreated. A consumer that goes on
at its old position then skips every record the new log holds below it; on tansu nobody says
so (measured: 4,014 of 27,000 spans skipped, no error in any log). Every consumer (the stream
worker, the runners, the trainer) feeds a :class:`LogWatch` with what it reads and what the
broker reports, and on a :class:`LogReset` logs its one line and follows :data:`POLICY`:
read the partition again from the start of its log. Replays are harmless by design: span,
rollout and transition ids are deterministic (ClickHouse ReplacingMergeTree keeps one row per
id), the trainer skips transition ids it already trained, a task only starts a new attempt.

Two signs, one per kind of broker:

* *behind* (a broker that answers OffsetOutOfRange, as Apache Kafka does; tansu never did
  here): a record arrives below the offset the consumer expected next, without a seek of
  its own. aiokafka answers OffsetOutOfRange with ``auto_offset_reset`` by moving the position
  to the log start and logs it at INFO level only; faust then drops every record below its own
  read offset (``DROPPED MESSAGE``, a debug line) until the new log grows past the old position.
* *beyond* (tansu): the consumer's next offset is past the log end the broker reports in its Fetch
  responses. tansu answers a fetch past the end with no records and no error, so nothing else
  ever notices. The log end comes from the Fetch high watermark: tansu's ListOffsets(latest)
  (``end_offsets``) answers too low (see FACTS.md).

Measured on tansu 0.6 (memory://, aiokafka 0.14): after 100 records in batches of 10 the Fetch
high watermark said 100 and ListOffsets(latest) 91; a fetch at 500 on a 135-record log
returned nothing, no error, high watermark 135, for as long as it was repeated; after a broker
restart the group's committed offsets were gone, and a commit of offset 135 from a client
that was no member of the group was accepted on a 20-record log, after which a member
joining that group read nothing. That is the likely path by which a worker under load skipped
the new log (not observed step by step): it commits what it acknowledged during the outage as
soon as the broker answers, then rejoins and seeks to it. Without such a commit the rejoin
finds no offsets and starts at the log start, and nothing is skipped. The high watermark was
exact in these runs; FACTS.md reports it trailing committed offsets by a few records, hence
``settle_s`` below.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import IllegalStateError

log = logging.getLogger("agentstream.logreset")

POLICY = "reprocess the partition from the start of its log (ids make the replay harmless)"


@dataclass(frozen=True)
class LogReset:
    """One partition whose log no longer holds the consumer's position, and why we think so."""

    component: str
    topic: str
    partition: int
    position: int  # the offset the consumer expected to read next
    log_end: int | None  # where the partition's log ends now (None: no fetch has said yet)
    cause: str

    def line(self) -> str:
        end = "at an unknown offset" if self.log_end is None else f"at {self.log_end}"
        return (f"log reset on {self.topic}[{self.partition}]: {self.component} was at offset {self.position}, "
                f"the log now ends {end} ({self.cause}); policy: {POLICY}")

    def report(self) -> None:
        log.warning(self.line())


class LogWatch:
    """Per partition, the next offset a consumer expects, checked against the records and log ends it sees.

    ``settle_s``: a position past the reported log end must stay so this long before it counts.
    tansu's Fetch high watermark can trail the records just written by a few (see FACTS.md); a
    wiped log stays short until something writes to it, so a real reset outlasts the wait.
    """

    def __init__(self, component: str, settle_s: float = 2.0) -> None:
        self.component = component
        self.settle_s = settle_s
        self._next: dict[tuple[str, int], int] = {}
        self._beyond_since: dict[tuple[str, int], float] = {}

    def expect(self, topic: str, partition: int, offset: int | None) -> None:
        """The consumer (re)positioned itself: ``offset`` is what it reads next (None: unknown, check nothing)."""
        key = (topic, partition)
        self._beyond_since.pop(key, None)
        if offset is None:
            self._next.pop(key, None)
        else:
            self._next[key] = offset

    def forget(self, topic: str, partition: int) -> None:
        """The partition was revoked: its expectations go with it."""
        self.expect(topic, partition, None)

    def expected(self, topic: str, partition: int) -> int | None:
        return self._next.get((topic, partition))

    def read(self, topic: str, partition: int, first: int, last: int, log_end: int | None = None) -> LogReset | None:
        """Records ``first``..``last`` arrived; a reset when they start below the expected offset."""
        key = (topic, partition)
        expected = self._next.get(key)
        self._next[key] = last + 1
        self._beyond_since.pop(key, None)
        if expected is not None and first < expected:
            return LogReset(self.component, topic, partition, expected, log_end,
                            f"records arrived from offset {first}: the broker reported the old position out of "
                            "range and the client moved back")
        return None

    def fetched(self, topic: str, partition: int, log_end: int | None, now: float | None = None,
                position: int | None = None) -> LogReset | None:
        """A fetch reported ``log_end`` (the high watermark); a reset once the position stays past it.

        ``position`` is the consumer's own next offset when it keeps one (faust), else the watch's.
        """
        key = (topic, partition)
        expected = self._next.get(key) if position is None else position
        if log_end is None or log_end < 0 or expected is None or expected <= log_end:
            self._beyond_since.pop(key, None)
            return None
        now = time.monotonic() if now is None else now
        since = self._beyond_since.setdefault(key, now)
        if now - since < self.settle_s:
            return None
        self._beyond_since.pop(key, None)
        return LogReset(self.component, topic, partition, expected, log_end,
                        f"the position stayed past the log end for {now - since:.1f} s")


class ConsumerLogWatch:
    """A :class:`LogWatch` over one aiokafka consumer: feed it every ``getmany`` result, it resets what needs it.

    On a reset the partition is moved to the start of its log (the *beyond* case; in the
    *behind* case aiokafka already moved it) and the reset is returned, so the caller can drop
    its own bookkeeping of the old positions before it commits anything.
    """

    def __init__(self, component: str, consumer: AIOKafkaConsumer, settle_s: float = 2.0) -> None:
        self.watch = LogWatch(component, settle_s)
        self.consumer = consumer

    def moved(self, tp: TopicPartition, offset: int | None) -> None:
        """The caller sought ``tp`` to ``offset`` (None: it was assigned and will start from its committed offset)."""
        self.watch.expect(tp.topic, tp.partition, offset)

    async def check(self, fetched: Mapping[TopicPartition, Sequence[ConsumerRecord]]) -> list[LogReset]:
        """Look at what one ``getmany`` returned and at the log ends; report, reposition and return the resets."""
        resets: list[LogReset] = []
        assigned = self.consumer.assignment()
        for tp, records in fetched.items():
            if records:
                reset = self.watch.read(tp.topic, tp.partition, records[0].offset, records[-1].offset,
                                        self.consumer.highwater(tp) if tp in assigned else None)
                if reset is not None:
                    reset.report()
                    resets.append(reset)
        for tp in assigned:
            if self.watch.expected(tp.topic, tp.partition) is None:
                self.watch.expect(tp.topic, tp.partition, await self._position(tp))
            reset = self.watch.fetched(tp.topic, tp.partition, self.consumer.highwater(tp))
            if reset is not None:
                reset.report()  # first: the seek waits for the broker's answer, up to the request timeout
                await self.consumer.seek_to_beginning(tp)
                self.watch.expect(tp.topic, tp.partition, None)
                resets.append(reset)
        return resets

    async def _position(self, tp: TopicPartition) -> int | None:
        """The consumer's position, or None while it has none yet (it is still looking up the committed offset)."""
        try:
            return await asyncio.wait_for(self.consumer.position(tp), 0.05)
        except (TimeoutError, IllegalStateError):
            return None

"""faust's Kafka transport with two corrections the stream processors rely on.

Fetch wait: faust builds its consumer with ``fetch_max_wait_ms=1500``. A broker that answers a
fetch as soon as data arrives makes that harmless, but tansu holds every fetch for the whole
wait when it has nothing at the moment the request comes in: records then reached the worker
up to 1.5 s late (measured: p50 390 ms, max 740 ms at 1500; 3 ms at 50).

Commits past a held record: a processor holds (does not acknowledge) the first record of every
open rollout, and faust commits up to the first offset not acknowledged. Its check for an
unacknowledged record at the head of a partition is off by one and skipped before the first
commit, so a held record there could be committed past, and a crash then lost its rollout.
Here no commit goes beyond the lowest offset still held.

Holes in a partition: a record past offsets not readable yet sends the partition back to the hole's
first offset, to be read again until its records appear (:mod:`agentstream.infra.gaps`: tansu's
durable storage raises the high watermark before it stores the batch).

These reach into faust and aiokafka internals, only through :mod:`agentstream.streams.dependency_adapters`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast
from weakref import WeakSet

import aiokafka
from faust.transport.drivers.aiokafka import Transport
from faust.types import TP, AppT, Message

from agentstream.infra.gaps import GapGuard
from agentstream.infra.logreset import LogReset, LogWatch
from agentstream.streams.dependency_adapters import (
    HookedConsumer,
    WorkerConsumerThread,
    acked_offsets,
    drop_unacked,
    forget_offsets,
    read_offset,
    set_fetch_max_wait,
    unacked_messages,
)

if TYPE_CHECKING:
    from yarl import URL  # faust's broker URLs


class _ConsumerThread(WorkerConsumerThread):
    def configure_worker_consumer(self, consumer: aiokafka.AIOKafkaConsumer, transport: Transport) -> None:
        set_fetch_max_wait(consumer, cast(StreamsTransport, transport).fetch_max_wait_ms)


class StreamsConsumer(HookedConsumer):
    """faust's consumer with commits bounded by held records and log resets noticed (see the module docstring)."""

    consumer_thread = _ConsumerThread
    _log_watch: LogWatch | None = None
    _stale: WeakSet | None = None
    _gap_guard: GapGuard | None = None

    @property
    def log_watch(self) -> LogWatch:
        if self._log_watch is None:
            self._log_watch = LogWatch("streams worker")
        return self._log_watch

    @property
    def gap_guard(self) -> GapGuard:
        if self._gap_guard is None:
            patience_s = cast(StreamsTransport, self.transport).read_gap_patience_s
            self._gap_guard = GapGuard(self.log_watch.component, patience_s)
        return self._gap_guard

    async def getmany(self, timeout: float) -> AsyncIterator[tuple[TP, Message]]:
        """faust's batches, after checking that none starts below the read offset (faust would drop it silently)
        and that none follows a hole (the partition is read again from the hole)."""
        guard, rereading = self.gap_guard, set()
        async for tp, message in super().getmany(timeout):
            if tp in rereading:  # past a hole: read again from it
                continue
            read = read_offset(self, tp)
            if read is not None and message.offset < read:
                LogReset(self.log_watch.component, tp.topic, tp.partition, read, self._log_end(tp),
                         f"records arrived from offset {message.offset}: the broker reported the old position out "
                         f"of range and the client moved back").report()
                self._start_over(tp)
                guard.forget(tp)
            elif read is None:  # faust's offset 0 and its unknown look alike: no hole is known
                guard.forget(tp)
            elif read != guard.last(tp):  # faust moved it (an assignment, a seek): read is the next offset
                guard.expect(tp, read)
            again = guard.admit(tp, message.offset, f"{tp.topic}[{tp.partition}]")
            if again is not None:
                rereading.add(tp)
                await self.seek(tp, again)
                continue
            yield tp, message

    async def check_log_ends(self) -> None:
        """Move each partition whose read offset stays past the log end back to the start of its log."""
        for tp in self.assignment():
            reset = self.log_watch.fetched(tp.topic, tp.partition, self._log_end(tp), position=read_offset(self, tp))
            if reset is None:
                continue
            reset.report()
            start = (await self.earliest_offsets(tp)).get(tp, 0)
            self._start_over(tp)
            await self.seek(tp, start)

    def _log_end(self, tp: TP) -> int | None:
        """The high watermark of the latest Fetch response (tansu's ListOffsets(latest) answers too low)."""
        try:
            return self.highwater(tp)
        except AssertionError:  # aiokafka asserts the partition is assigned: a rebalance is under way
            return None

    def _start_over(self, tp: TP) -> None:
        """Forget ``tp``'s offsets; the records still held from the old log are released without counting."""
        stale = self._stale = self._stale if self._stale is not None else WeakSet()
        stale.update(unacked_messages(self, tp))
        forget_offsets(self, tp)

    def ack(self, message: Message) -> bool:
        if self._stale is not None and message in self._stale:
            drop_unacked(self, message)
            return False
        return super().ack(message)

    def commit_offset(self, tp: TP) -> int | None:
        stale = self._stale or ()
        held = [message.offset for message in unacked_messages(self, tp) if message not in stale]
        if not held:
            return super().commit_offset(tp)
        floor = min(held)
        acked = acked_offsets(self, tp)
        above = [offset for offset in acked if offset >= floor]
        acked[:] = [offset for offset in acked if offset < floor]  # faust may only commit what lies below
        try:
            return super().commit_offset(tp)
        finally:
            acked.extend(above)


class StreamsTransport(Transport):
    """The aiokafka transport with a short fetch wait and commits that never pass a held record."""

    Consumer = StreamsConsumer

    def __init__(self, url: list[URL], app: AppT, fetch_max_wait_ms: int, read_gap_patience_s: float,
                 **kwargs: Any) -> None:
        super().__init__(url, app, **kwargs)
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.read_gap_patience_s = read_gap_patience_s

"""The publisher's background side: one uvloop loop in its own thread that delivers queued spans to Kafka.

The loop takes the accumulator's queue in *waves*: it groups a wave's spans per rollout into
SpanBatch records keyed by rollout_id (varint-encoding the token ids of the whole wave in one
numpy pass), puts at most one producer batch per partition on the wire (acks=all) and waits for
the broker's answer before it takes the next wave. One wave at a time is what keeps a rollout's
records in order, also through failures: a RolloutEvent lands after every span of its rollout
published before it.

When a wave fails because the broker is unreachable (its address refuses connections while an
answer is overdue, or requests time out) or answers with any error that is not about the records
themselves (a failing store, an unknown server error), its unacknowledged records and everything
published after them go to the :class:`~pipeline.publisher.journal.Journal`, with one warning. A probe
watches for the broker; once it answers, the journal is replayed in order before anything new
is sent, then deleted. A publisher that closes while journaling asks the broker once more: if it
answers, the journal is replayed until the close deadline, and only what is left then stays for
the next publisher started on that directory.

A refusal is not an outage: when the cluster refuses the login or the topic's ACL refuses the
principal (:class:`~infra.kafka.KafkaRefused`), what is not acknowledged is journaled, the loop
stops, and ``start``, ``publish`` and ``flush`` raise that named error from then on.

It is one module of about 500 lines on purpose: the wave loop, the hand-off to the journal and the probe share
one thread's state and one ordering argument.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    CorruptRecordException,
    InvalidTimestampError,
    InvalidTopicError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    PolicyViolationError,
    RecordListTooLargeError,
    TopicAuthorizationFailedError,
    UnsupportedForMessageFormatError,
)
from aiokafka.partitioner import DefaultPartitioner

from agentstream.infra.config import KafkaConfig
from agentstream.infra.kafka import KafkaRefused, access_denied, client_options, refusal, start_producer
from agentstream.pipeline.publisher import aiokafka_compat
from agentstream.pipeline.publisher.accumulator import Accumulator
from agentstream.pipeline.publisher.errors import PublisherError
from agentstream.pipeline.publisher.journal import Journal, Record

log = logging.getLogger(__name__)

JOURNAL_CHUNK_BYTES = 256 * 1024  # one append (and fsync) each: what a nearly full disk may still take


class _State(enum.Enum):
    """Where fresh records go: to the broker, to the journal (broker away), or after the journal's replay."""

    CONNECTED = "connected"
    JOURNALING = "journaling"
    REPLAYING = "replaying"


@dataclass(frozen=True)
class SenderSettings:
    """Where the loop side sends, where it journals, and how it paces itself; fixed when the publisher is made."""

    topic: str
    bootstrap_servers: str
    kafka: KafkaConfig
    producer_options: dict[str, Any]
    journal_dir: Path
    wave_bytes: int
    request_timeout_s: float
    probe_interval_s: float

    @classmethod
    def create(cls, kafka: KafkaConfig, topic: str, bootstrap_servers: str, *, journal_dir: Path, batch_bytes: int,
               request_timeout_ms: int, probe_interval_s: float) -> SenderSettings:
        """The settings of a publisher of `topic`, with the producer options every publisher uses."""
        producer_options = {
            **client_options(kafka, bootstrap_servers),
            "acks": "all",
            "max_batch_size": batch_bytes,
            "request_timeout_ms": request_timeout_ms,
            "retry_backoff_ms": 250,  # fewer retries (and fewer aiokafka log lines) while we find out a broker is gone
        }
        return cls(topic=topic, bootstrap_servers=bootstrap_servers, kafka=kafka, producer_options=producer_options,
                   journal_dir=Path(journal_dir), wave_bytes=4 * batch_bytes,
                   request_timeout_s=request_timeout_ms / 1000, probe_interval_s=probe_interval_s)


class SenderThread:
    """The thread that runs a :class:`Sender` on its own uvloop event loop, as the caller's side sees it.

    It is the only way in from other threads: start, wake the loop, ask it to stop, join it.
    """

    def __init__(self, queue: Accumulator, settings: SenderSettings) -> None:
        self._queue = queue
        self._settings = settings
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender: Sender | None = None  # set in the loop thread, with _loop
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None

    @property
    def started(self) -> bool:
        """True once start() was called (whether or not the loop still runs)."""
        return self._thread is not None

    def is_alive(self) -> bool:
        """True while the loop thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread and wait until the loop has connected or begun journaling; PublisherError if it failed."""
        self._thread = threading.Thread(target=self._thread_main, name=f"agentstream-publisher-{self._settings.topic}",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if isinstance(self._startup_error, KafkaRefused):
            raise self._startup_error
        if self._startup_error is not None:
            raise PublisherError(f"publisher could not start: {self._startup_error}") from self._startup_error

    def wake(self) -> None:
        """Make the loop look at the queue now (a flush waits)."""
        self._call_in_loop(Sender.wake)

    def stop(self) -> None:
        """Tell the loop the publisher is closing (the accumulator already refuses new spans)."""
        self._call_in_loop(Sender.stop)

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end; True when it did."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def state_name(self, closing: bool) -> str:
        """"closed" once closing and the loop has stopped, else the loop's state (connected, journaling, replaying)."""
        if closing and not self.is_alive():
            return "closed"
        sender = self._sender
        return (sender.state if sender is not None else _State.CONNECTED).value

    def _call_in_loop(self, callback: Callable[[Sender], object]) -> None:
        loop, sender = self._loop, self._sender
        if loop is not None and sender is not None:
            try:
                loop.call_soon_threadsafe(callback, sender)
            except RuntimeError:  # the loop has stopped
                pass

    def _thread_main(self) -> None:
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(self._main())
        except BaseException as error:
            log.exception("span publisher for %s stopped on an unexpected error", self._settings.topic)
            self._startup_error = self._startup_error or error
        finally:
            self._queue.refuse(wake_waiters=True)
            self._ready.set()

    async def _main(self) -> None:
        try:
            journal = Journal(self._settings.journal_dir, self._settings.topic)
            wakeup, closing = asyncio.Event(), asyncio.Event()
            loop = asyncio.get_running_loop()
            sender = Sender(self._queue, self._settings, journal, wakeup, closing)
        except BaseException as error:
            self._startup_error = error
            raise
        self._sender, self._loop = sender, loop
        self._queue.attach(functools.partial(loop.call_soon_threadsafe, wakeup.set))
        try:
            await sender.connect()
            self._ready.set()
            await sender.serve()
        except KafkaRefused as refused:
            log.error("span publisher for %s stopped: %s", self._settings.topic, refused)
            self._queue.fail(refused)
            if not self._ready.is_set():
                self._startup_error = refused
        finally:
            await sender.shutdown()


class Sender:
    """The loop side: takes waves from the accumulator, delivers them, and journals and replays through outages.

    Everything here belongs to the loop thread; other threads reach it only through
    :class:`SenderThread` (``wake`` and ``stop`` run in the loop).
    """

    def __init__(self, queue: Accumulator, settings: SenderSettings, journal: Journal, wakeup: asyncio.Event,
                 closing: asyncio.Event) -> None:
        self.topic = settings.topic
        self.bootstrap_servers = settings.bootstrap_servers
        self._queue = queue
        self._kafka, self._producer_options = settings.kafka, settings.producer_options
        self._wave_bytes = settings.wave_bytes
        self._request_timeout_s = settings.request_timeout_s
        self._probe_interval_s = settings.probe_interval_s
        self._journal = journal
        self._wakeup = wakeup  # set from other threads too, through SenderThread and the accumulator
        self._closing_event = closing
        self._partitioner = DefaultPartitioner()
        self._partitions: dict[bytes, int] = {}
        self._partition_list: list[int] = []
        self._producer: AIOKafkaProducer | None = None
        self.state = _State.CONNECTED
        self._carry: list[Record] = []  # taken but did not fit this wave's producer batches
        self._held: list[Record] = []  # the journal's disk refused them: unsettled, so publishers wait for room
        self._held_since: float | None = None
        self._replay_head: list[Record] = []  # read from the journal, not yet acknowledged
        self._asked_at_close = False  # closing while journaling asks the broker once before leaving the journal
        self._replay_used = 0
        self._replayed = [0, 0]  # records, spans since the outage began
        self._probe: asyncio.Task | None = None
        self._refused: KafkaRefused | None = None  # found by the probe: the serve loop raises it

    def wake(self) -> None:
        """Look at the queue now."""
        self._wakeup.set()

    def stop(self) -> None:
        """The publisher is closing: stop waiting for answers at the close deadline, and look at the queue now."""
        self._closing_event.set()
        self._wakeup.set()

    async def connect(self) -> None:
        """Start the producer (or journal from the start when the broker is away); replay a journal left behind."""
        if await self._start_producer() is None:
            await self._enter_outage("cannot connect")
        elif not self._journal.empty:
            log.info("replaying spans journaled by an earlier run from %s", self._journal.directory)
            self.state = _State.REPLAYING

    async def serve(self) -> None:
        """Send, journal or replay wave after wave until the publisher closes."""
        queue = self._queue
        while True:
            await self._wait_for_work()
            if self._refused is not None:
                raise self._refused
            if queue.closing and self.state is _State.JOURNALING and not self._asked_at_close:
                self._asked_at_close = True
                await self._ask_broker_before(queue.close_deadline)
            if queue.closing and (self.state is _State.JOURNALING or time.monotonic() >= queue.close_deadline):
                self._journal_wave(self._carry + queue.build_records(queue.take(None)))
                self._carry = []
                return
            if self.state is _State.REPLAYING:
                await self._replay_some()
                if self.state is _State.REPLAYING and (queue.half_full or queue.flush_waiting):
                    self._journal_wave(queue.build_records(queue.take(None)))
            else:
                records = self._carry + queue.build_records(queue.take(self._wave_bytes))
                self._carry = []
                if self.state is _State.CONNECTED:
                    if self._held:  # the broker is back and the journal is replayed: what the disk refused is next
                        records, self._held, self._held_since = self._held + records, [], None
                    await self._send_wave(records)
                else:
                    self._journal_wave(records)
            if queue.closing and self.state is _State.CONNECTED and not queue.has_pending and not self._carry:
                return

    async def _ask_broker_before(self, deadline: float) -> None:
        """Closing while journaling: ask the broker once more, so that a broker back a moment ago gets the journal
        replayed before the close deadline instead of leaving it to the next publisher on this directory."""
        try:
            answers = await asyncio.wait_for(self._broker_answers(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return
        if answers:
            log.info("span publisher for %s is closing and the broker is back: replaying the journal in %s until "
                     "the close deadline", self.topic, self._journal.directory)
            self.state = _State.REPLAYING

    async def shutdown(self) -> None:
        """Journal what is left (only after an unexpected error), stop the producer and release the journal."""
        self._queue.refuse(wake_waiters=False)  # also when the loop stops on an error: publish() refuses from now on
        leftovers = self._carry + self._queue.build_records(self._queue.take(None))
        if leftovers:  # only after an unexpected error
            self._journal_wave(leftovers)
        if self._held:  # the one loss left: closing while neither the broker nor the disk takes records
            held, self._held = self._held, []
            self._drop(held, OSError(f"the journal in {self._journal.directory} refused them until the publisher "
                                     "closed, and the broker did not take them"))
        if self._probe is not None:
            self._probe.cancel()
        if self._producer is not None:
            try:
                await asyncio.wait_for(self._producer.stop(),
                                       max(1.0, self._queue.close_deadline - time.monotonic()))
            except (TimeoutError, KafkaError, OSError) as error:
                log.warning("span publisher for %s: the Kafka producer did not stop cleanly: %r", self.topic, error)
        if not self._journal.empty:
            log.warning("spans for %s stay journaled in %s; the next publisher started on that directory "
                        "replays them", self.topic, self._journal.directory)
        self._journal.close()

    async def _wait_for_work(self) -> None:
        """Until a wave is due: linger elapsed, a full wave queued, a flush or close asked, or a journal to replay."""
        while True:
            self._wakeup.clear()
            if self._carry or self.state is _State.REPLAYING or self._refused is not None:
                return
            linger = self._queue.until_wave_due()
            if self._held:  # try the journal (or the broker) again
                linger = self._probe_interval_s if linger is None else min(linger, self._probe_interval_s)
            if linger is not None and linger <= 0:
                return
            try:
                await asyncio.wait_for(self._wakeup.wait(), linger)
            except TimeoutError:
                return

    async def _send_wave(self, records: list[Record]) -> None:
        """Send fresh records; the acknowledged are settled, the rest carried, journaled or dropped."""
        delivered, carried, failed, error = await self._deliver(records)
        self._queue.count("spans_published", sum(r.spans for r in delivered))
        self._queue.count("events_published", sum(1 for r in delivered if not r.spans))
        if error is not None and (refused := await refusal(self._producer_options, error, f"writing {self.topic}")):
            self._queue.fail(refused)  # before the journal settles them: a flush waiting for them raises it
            sent = {id(r) for r in delivered}
            self._journal_wave([r for r in records if id(r) not in sent])
            raise refused
        if error is not None and _unreachable(error):
            sent = {id(r) for r in delivered}
            self._journal_wave([r for r in records if id(r) not in sent])
            await self._enter_outage(error)
            return
        if error is not None:
            self._drop(failed, error)
        self._carry = carried
        self._settle(delivered + failed)

    async def _replay_some(self) -> None:
        """Send the next part of the journal; when it is all acknowledged, delete it and connect directly again."""
        if not self._replay_head:
            self._replay_head, self._replay_used = self._journal.read(self._wave_bytes)
        if self._replay_head:
            delivered, carried, failed, error = await self._deliver(self._replay_head)
            self._replayed[0] += len(delivered)
            self._replayed[1] += sum(r.spans for r in delivered)
            self._queue.count("records_replayed", len(delivered))
            self._queue.count("spans_replayed", sum(r.spans for r in delivered))
            if error is not None and (refused := await refusal(self._producer_options, error,
                                                               f"writing {self.topic}")):
                raise refused  # the unacknowledged stay in the journal for the next publisher
            if error is not None and _unreachable(error):
                sent = {id(r) for r in delivered}
                self._replay_head = [r for r in self._replay_head if id(r) not in sent]
                await self._enter_outage(error)
                return
            if error is not None:
                self._drop(failed, error)
            self._replay_head = carried
            if carried:
                return
            self._journal.consume(self._replay_used)
        if self._journal.empty:
            records, spans = self._replayed
            log.info("Kafka broker %s is back: replayed %d records (%d spans) from the journal in %s",
                     self.bootstrap_servers, records, spans, self._journal.directory)
            self._replayed = [0, 0]
            self.state = _State.CONNECTED

    async def _deliver(self, records: list[Record]) -> tuple[list[Record], list[Record], list[Record],
                                                              BaseException | None]:
        """Put one producer batch per partition on the wire and wait for the broker's answers.

        Returns the acknowledged records, those that did not fit their partition's batch (to go
        first in the next wave), those that failed, and the first error.
        """
        delivered: list[Record] = []
        carried: list[Record] = []
        failed: list[Record] = []
        error: BaseException | None = None
        sent: dict[asyncio.Future, list[Record]] = {}
        try:
            producer = self._producer
            assert producer is not None, "waves are sent only while connected or replaying, with a producer"
            partitions = sorted(await asyncio.wait_for(producer.partitions_for(self.topic), self._request_timeout_s))
            batches, carried = self._fill_batches(producer, records, partitions)
            for partition, (builder, members) in batches.items():
                sent[await producer.send_batch(builder, self.topic, partition=partition)] = members
        except (TimeoutError, KafkaError, OSError) as problem:
            error = problem
            on_the_wire = {id(r) for members in sent.values() for r in members}
            failed, carried = [r for r in records if id(r) not in on_the_wire], []
        unanswered, gave_up = await self._wait_for_answers(sent)
        for future, members in sent.items():
            failure = gave_up if future in unanswered else future.exception()
            if failure is None:
                delivered += members
            else:
                failed += members
                error = error or failure
        return delivered, carried, failed, error

    def _fill_batches(self, producer: AIOKafkaProducer, records: list[Record],
                      partitions: list[int]) -> tuple[dict[int, tuple[Any, list[Record]]], list[Record]]:
        """At most one producer batch per partition, filled in order; the records that do not fit are carried."""
        batches: dict[int, tuple[Any, list[Record]]] = {}
        carried: list[Record] = []
        full: set[int] = set()
        for record in records:
            partition = self._partition(record.key, partitions)
            if partition not in full:
                batch = batches.get(partition)
                if batch is None:
                    batch = batches[partition] = (producer.create_batch(), [])
                if batch[0].append(key=record.key, value=record.value, timestamp=None) is not None:
                    batch[1].append(record)
                    continue
                full.add(partition)
            carried.append(record)
        return batches, carried

    async def _wait_for_answers(self, futures: Iterable[asyncio.Future]) -> tuple[set[asyncio.Future],
                                                                                    BaseException | None]:
        """Wait for the broker's answers; returns those not answered and why we stopped waiting for them.

        We stop when the bootstrap address refuses connections (checked whenever no answer came for
        a probe interval: faster and quieter than aiokafka's retries until its request timeout), after
        the request timeout ourselves (an idempotent aiokafka producer never expires a batch: with two
        of three brokers down it retries "not enough replicas" for ever while another broker's port is
        open, and the journal would never take over) and, once the publisher is closing, at the close
        deadline.
        """
        waiting = set(futures)
        closing = asyncio.ensure_future(self._closing_event.wait())
        deadline = time.monotonic() + self._request_timeout_s
        try:
            while waiting and not closing.done():
                done, _ = await asyncio.wait(waiting | {closing}, timeout=self._probe_interval_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                waiting = {future for future in waiting if not future.done()}
                if waiting and not done and not await _port_open(self.bootstrap_servers):
                    return waiting, KafkaConnectionError(f"cannot connect to {self.bootstrap_servers}")
                if waiting and time.monotonic() > deadline:
                    return waiting, KafkaTimeoutError(f"no answer within the request timeout "
                                                      f"({self._request_timeout_s:g} s)")
            if waiting:
                _, waiting = await asyncio.wait(waiting,
                                                timeout=max(0.0, self._queue.close_deadline - time.monotonic()))
        finally:
            closing.cancel()
        return waiting, KafkaTimeoutError("no answer from the broker before the publisher had to close")

    def _partition(self, key: bytes, partitions: list[int]) -> int:
        """The default partitioner's choice (murmur2 of the key), cached: the pure-Python hash is slow."""
        if partitions != self._partition_list or len(self._partitions) > 1 << 16:
            self._partitions, self._partition_list = {}, partitions
        partition = self._partitions.get(key)
        if partition is None:
            partition = self._partitions[key] = self._partitioner(key, partitions, partitions)
        return partition

    def _journal_wave(self, records: list[Record]) -> None:
        """Append the held records, then `records`, to the journal (after everything in it) and settle them.

        When the disk refuses the write (full, read-only), nothing is dropped: the records stay held,
        unsettled, so their buffer space stays taken and publishers meet back-pressure (a blocking
        ``publish``, a 503 at the proxy and the collector) until the journal takes them or the broker does.
        """
        records, self._held = self._held + records, []
        if not records:
            return
        appended = 0
        for chunk in _chunks(records, JOURNAL_CHUNK_BYTES):  # a nearly full disk still takes the first ones
            try:
                self._journal.append(chunk)
            except OSError as error:
                self._hold(records[appended:], error)
                self._settle_journaled(records[:appended])
                return
            appended += len(chunk)
        self._settle_journaled(records)

    def _settle_journaled(self, records: list[Record]) -> None:
        """Count and settle records the journal took; say so once when that ends a time of holding."""
        if not records:
            return
        if self._held_since is not None and not self._held:
            log.warning("span publisher for %s: the journal in %s takes writes again after %.1f s; %d held records "
                        "journaled", self.topic, self._journal.directory, time.monotonic() - self._held_since,
                        len(records))
            self._held_since = None
        self._queue.count("records_journaled", len(records))
        self._queue.count("spans_journaled", sum(r.spans for r in records))
        self._settle(records)

    def _hold(self, records: list[Record], error: OSError) -> None:
        """Keep records neither the broker nor the journal took, in order, to try again every probe interval."""
        self._held = records
        self._queue.count("journal_write_failures", 1)
        if self._held_since is None:
            self._held_since = time.monotonic()
            log.error("span publisher for %s cannot journal to %s (%s): holding %d records (%d spans) in memory; "
                      "publishers wait for room until the disk has space or the broker is back", self.topic,
                      self._journal.directory, _describe(error), len(records), sum(r.spans for r in records))

    def _drop(self, records: list[Record], error: BaseException) -> None:
        if records:
            log.error("dropped %d records (%d spans) for %s: %r", len(records), sum(r.spans for r in records),
                      self.topic, error)
            self._queue.count("records_dropped", len(records))
            self._settle(records)

    def _settle(self, records: list[Record]) -> None:
        """Settle records acknowledged, journaled or dropped; those carried to the next wave and those held (as of
        now) stay open."""
        self._queue.settle(records, self._carry + self._held)

    async def _enter_outage(self, error: BaseException | str) -> None:
        self.state = _State.JOURNALING
        log.warning("Kafka broker %s is unreachable (%s): journaling spans to %s until it is back",
                    self.bootstrap_servers, _describe(error), self._journal.location)
        await self._abandon_producer()
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._watch_broker())

    async def _abandon_producer(self) -> None:
        """Drop the producer and what it still holds (those records are journaled already).

        Left alone, aiokafka would retry them until its request timeout, logging each attempt, and
        could deliver them after the journal replay: out of order and twice. It has no public way
        to drop queued batches, so this stops its sender task and closes its connections.
        """
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            await aiokafka_compat.abandon_producer(producer, self._request_timeout_s)
        except (TimeoutError, KafkaError, OSError) as problem:
            log.debug("abandoned Kafka producer did not stop cleanly: %r", problem)

    async def _watch_broker(self) -> None:
        """Probe the broker until it answers and has the topic, then switch to replaying the journal; a refusal
        (login or ACL) ends the probing and is handed to the serve loop."""
        while self.state is _State.JOURNALING and not self._queue.closing:
            await asyncio.sleep(self._probe_interval_s)
            try:
                answers = await self._broker_answers()
            except KafkaRefused as refused:
                self._refused = refused
                self._wakeup.set()
                return
            if answers:
                self.state = _State.REPLAYING
                self._wakeup.set()

    async def _broker_answers(self) -> bool:
        if not await _port_open(self.bootstrap_servers):  # quiet, unlike a failing Kafka client
            return False
        producer = self._producer
        if producer is None:
            producer = await self._start_producer()
            if producer is None:
                return False
        try:
            metadata = await asyncio.wait_for(aiokafka_compat.fetch_all_metadata(producer), self._request_timeout_s)
            if self.topic in metadata.unauthorized_topics:
                raise access_denied(self._producer_options, TopicAuthorizationFailedError(self.topic),
                                    f"writing {self.topic}")
            if self.topic not in metadata.topics():
                return False
            await asyncio.wait_for(aiokafka_compat.force_metadata_update(producer), self._request_timeout_s)
        except (TimeoutError, KafkaError, OSError):
            return False
        return True

    async def _start_producer(self) -> AIOKafkaProducer | None:
        """A started producer, kept as the one to send with; None when it could not connect (KafkaRefused when
        the broker answered and refused the login)."""
        try:
            producer = await start_producer(self._kafka, self._producer_options)
        except (TimeoutError, KafkaError, OSError) as error:
            if refused := await refusal(self._producer_options, error, "logging in"):
                raise refused from error
            return None
        self._producer = producer
        return producer


RECORD_REFUSALS = (CorruptRecordException, MessageSizeTooLargeError, RecordListTooLargeError, InvalidTopicError,
                   InvalidTimestampError, UnsupportedForMessageFormatError, PolicyViolationError)
"""The broker's answers about the records themselves: sending them again would be refused again."""


def _unreachable(error: BaseException) -> bool:
    """True unless the broker refused the records themselves: every other failure is an outage to journal through.

    A broker whose storage fails answers with errors aiokafka calls fatal (tansu's ``UNKNOWN_SERVER_ERROR``
    while its object store is full); dropping on those would lose acknowledged spans, so only
    :data:`RECORD_REFUSALS` drop.
    """
    return not isinstance(error, RECORD_REFUSALS)


def _chunks(records: list[Record], max_bytes: int) -> Iterable[list[Record]]:
    """``records`` in order, in runs of about ``max_bytes`` (at least one record each)."""
    start, size = 0, 0
    for index, record in enumerate(records):
        if size and size + record.nbytes > max_bytes:
            yield records[start:index]
            start, size = index, 0
        size += record.nbytes
    if start < len(records):
        yield records[start:]


def _describe(error: BaseException | str) -> str:
    return error if isinstance(error, str) else (str(error) or type(error).__name__)


async def _port_open(bootstrap_servers: str) -> bool:
    """True when some bootstrap address accepts a TCP connection."""
    for address in bootstrap_servers.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), 2.0)
        except (TimeoutError, OSError, ValueError):
            continue
        writer.close()
        return True
    return False

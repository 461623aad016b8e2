"""Publishes spans and rollout events to Kafka from any thread, and keeps them on local disk while the broker is away.

A :class:`SpanPublisher` owns an aiokafka producer running on its own uvloop event loop in a
background thread. ``publish`` checks and mostly encodes a span in the caller's thread
(``schemas.spanwriter``) and queues it. The loop takes the queue in *waves*: it groups a wave's
spans per rollout into SpanBatch records keyed by rollout_id, varint-encodes the token ids of
the whole wave in one numpy pass, puts at most one producer batch per partition on the wire
(acks=all) and waits for the broker's answer before it takes the next wave. One wave at a time
is what keeps a rollout's records in order, also through failures: a RolloutEvent lands after
every span of its rollout published before it.

When a wave fails because the broker is unreachable (its address refuses connections while an
answer is overdue, or requests time out), its unacknowledged records and everything published
after them go to an append-only :class:`Journal` on local disk, with one warning. A probe watches for the broker; once it
answers, the journal is replayed in order before anything new is sent, then deleted. A journal
left by a crashed process is replayed by the next publisher started on the same directory.
Spans still in memory are flushed when the interpreter exits and on SIGTERM.
"""

from __future__ import annotations

import asyncio
import atexit
import enum
import fcntl
import logging
import os
import signal
import struct
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import uvloop
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError
from aiokafka.partitioner import DefaultPartitioner

from infra.config import Config
from infra.kafka import client_options, topic_name
from schemas import ROLLOUT_EVENT, AvroCodec
from schemas.spanwriter import PreparedSpan, SpanBatchEncoder, prepare_span

log = logging.getLogger(__name__)

_JOURNAL_MAGIC = b"ASJ1"
_RECORD_HEAD = struct.Struct("<II")  # body length, CRC-32 of the body
_BODY_HEAD = struct.Struct("<IH")  # spans in the record, key length
_MAX_JOURNAL_RECORD = 1 << 30  # a longer length field can only be garbage


class PublisherError(RuntimeError):
    """Base class of the publisher's errors."""


class PublisherClosed(PublisherError):
    """The publisher is closed (or was never started), so it takes no more spans."""


class FlushTimeout(PublisherError):
    """flush() ran out of time before every span published before it was acknowledged or journaled."""


@dataclass(frozen=True)
class PublisherStats:
    """Where the spans and events went since the publisher started."""

    spans_published: int
    """Spans acknowledged by the broker when first sent."""
    events_published: int
    spans_journaled: int
    records_journaled: int
    records_replayed: int
    """Journal records (SpanBatch or RolloutEvent) acknowledged by the broker after an outage or a crash."""
    spans_replayed: int
    records_dropped: int
    """Records the broker refused for good (for example too large); each one was logged as an error."""
    buffered_bytes: int
    state: str


class _State(enum.Enum):
    CONNECTED = "connected"
    JOURNALING = "journaling"
    REPLAYING = "replaying"


@dataclass(slots=True)
class _Record:
    """One Kafka record: key, wire-format value, how many spans it carries, and what it settles."""

    key: bytes
    value: bytes
    spans: int
    first_seq: int = -1
    """Sequence number of the oldest publish() call inside; -1 for records read back from the journal."""
    nbytes: int = 0
    """Buffered bytes it gives back when it is acknowledged or journaled."""


@dataclass(slots=True)
class _Run:
    """Consecutive spans of one rollout that will become one SpanBatch record."""

    rollout_id: str
    first_seq: int
    spans: list[PreparedSpan] = field(default_factory=list)
    nbytes: int = 0


@dataclass(slots=True)
class _Segment:
    """One journal file, held with an exclusive flock by this process."""

    path: Path
    fd: int
    start: int  # offset of the first record, after the header
    size: int  # end of the complete records


class Journal:
    """Kafka records of one topic kept on local disk while the broker is unreachable, to be replayed in order.

    Each process writes its own file ``<topic>.<pid>.<random>.journal`` and holds an exclusive
    flock on every file it writes or replays, so files of a crashed process are recognised (their
    lock is free) and adopted by the next journal opened on the directory for the same topic.
    A file is the magic ``ASJ1``, the topic (u16 length + UTF-8), then records: u32 body length,
    u32 CRC-32 of the body, body = u32 span count, u16 key length, key, value (little-endian).
    Appends are fsync'd once per batch; a record cut short or failing its CRC ends its file, which
    is what a crash in the middle of a write leaves behind.
    """

    def __init__(self, directory: Path, topic: str) -> None:
        self.directory = directory
        self.topic = topic
        self._header = _JOURNAL_MAGIC + struct.pack("<H", len(topic.encode())) + topic.encode()
        directory.mkdir(parents=True, exist_ok=True)
        self._segments: deque[_Segment] = deque(self._adopt_orphans())
        self._writer: _Segment | None = None
        self._offset = self._segments[0].start if self._segments else 0  # read position in the first segment

    @property
    def empty(self) -> bool:
        """True when no record is waiting to be replayed."""
        return all(segment.size <= (self._offset if i == 0 else segment.start)
                   for i, segment in enumerate(self._segments))

    @property
    def location(self) -> Path:
        """The file being written, or the directory when there is none."""
        return self._writer.path if self._writer else self.directory

    def append(self, records: Iterable[_Record]) -> int:
        """Write `records` after everything already journaled and fsync them; returns the bytes written."""
        parts = []
        for record in records:
            body = _BODY_HEAD.pack(record.spans, len(record.key)) + record.key + record.value
            parts += (_RECORD_HEAD.pack(len(body), zlib.crc32(body)), body)
        if not parts:
            return 0
        writer = self._writer or self._new_segment()
        data = memoryview(b"".join(parts))
        written = 0
        while written < len(data):
            written += os.write(writer.fd, data[written:])
        os.fsync(writer.fd)
        writer.size += len(data)
        return len(data)

    def read(self, max_bytes: int) -> tuple[list[_Record], int]:
        """Records from the read position (about `max_bytes` of them, at least one) and the bytes they take."""
        while self._segments:
            segment = self._segments[0]
            records, used = self._read_segment(segment, max_bytes)
            if records or segment is self._writer:
                return records, used
            self._retire(self._segments.popleft())  # a crashed process's file, fully replayed
            self._offset = self._segments[0].start if self._segments else 0
        return [], 0

    def consume(self, used: int) -> None:
        """Mark `used` bytes after the read position as replayed; files replayed to the end are deleted."""
        self._offset += used
        segment = self._segments[0]
        if self._offset >= segment.size:
            self._retire(self._segments.popleft())
            if segment is self._writer:
                self._writer = None
            self._offset = self._segments[0].start if self._segments else 0

    def close(self) -> None:
        """Release the files; records not yet replayed stay on disk for the next journal on this directory."""
        for segment in self._segments:
            os.close(segment.fd)
        self._segments.clear()
        self._writer = None

    def _adopt_orphans(self) -> list[_Segment]:
        adopted = []
        for path in sorted(self.directory.glob(f"{self.topic}.*.journal")):  # each holds one process's records
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:  # its owner finished replaying it just now
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live process owns it
                os.close(fd)
                continue
            size = os.fstat(fd).st_size
            if size > 0 and os.pread(fd, len(self._header), 0) != self._header:
                log.warning("journal %s: not a journal of topic %s, left alone", path, self.topic)
                os.close(fd)
                continue
            adopted.append(_Segment(path, fd, len(self._header), max(size, len(self._header))))
        return adopted

    def _new_segment(self) -> _Segment:
        path = self.directory / f"{self.topic}.{os.getpid()}.{uuid.uuid4().hex[:12]}.journal"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, self._header)
        os.fsync(fd)
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)  # the new name survives a crash too
        finally:
            os.close(directory)
        segment = self._writer = _Segment(path, fd, len(self._header), len(self._header))
        if not self._segments:
            self._offset = segment.start
        self._segments.append(segment)
        return segment

    def _read_segment(self, segment: _Segment, max_bytes: int) -> tuple[list[_Record], int]:
        offset = self._offset
        data = os.pread(segment.fd, min(segment.size - offset, max(max_bytes, 1 << 20)), offset)
        records: list[_Record] = []
        position = 0
        while position + _RECORD_HEAD.size <= len(data) and position < max_bytes:
            length, crc = _RECORD_HEAD.unpack_from(data, position)
            end = position + _RECORD_HEAD.size + length
            if length > _MAX_JOURNAL_RECORD or offset + end > segment.size:
                break
            if end > len(data):  # a record longer than this read: read it whole
                data = os.pread(segment.fd, end, offset)
            body = data[position + _RECORD_HEAD.size:end]
            if length < _BODY_HEAD.size or zlib.crc32(body) != crc:
                break
            spans, key_length = _BODY_HEAD.unpack_from(body)
            key_end = _BODY_HEAD.size + key_length
            records.append(_Record(body[_BODY_HEAD.size:key_end], body[key_end:], spans))
            position = end
        if not records and offset + position < segment.size:
            log.warning("journal %s: ignored the last %d bytes, a record cut short by a crash",
                        segment.path, segment.size - offset - position)
            segment.size = offset + position
        return records, position

    def _retire(self, segment: _Segment) -> None:
        # Emptied before it is unlinked: a process that opened it meanwhile finds nothing to replay again.
        os.ftruncate(segment.fd, 0)
        segment.path.unlink(missing_ok=True)
        os.close(segment.fd)


class SpanPublisher:
    """Publishes spans (grouped per rollout into SpanBatch records) and rollout events to the spans topic.

    Thread-safe; ``publish`` only blocks while `max_buffered_bytes` of spans wait for the broker.
    Use it as a context manager, or call ``start()`` and ``close()``.
    """

    def __init__(self, config: Config, bootstrap_servers: str, *, journal_dir: Path, linger_ms: float = 10.0,
                 max_spans_per_record: int = 256, max_record_bytes: int = 512 * 1024, batch_bytes: int = 1_000_000,
                 max_buffered_bytes: int = 64 * 1024 * 1024, request_timeout_ms: int = 30_000,
                 probe_interval_s: float = 0.5, exit_timeout_s: float = 10.0) -> None:
        self.topic = topic_name(config.topics, "spans")
        self.bootstrap_servers = bootstrap_servers
        self._producer_options = {
            **client_options(config.kafka, bootstrap_servers),
            "acks": "all",  # idempotence stays off: tansu refuses InitProducerId (see FACTS.md)
            "max_batch_size": batch_bytes,
            "request_timeout_ms": request_timeout_ms,
            "retry_backoff_ms": 250,  # fewer retries (and fewer aiokafka log lines) while we find out a broker is gone
        }
        self._journal_dir = Path(journal_dir)
        self._linger_s = linger_ms / 1000
        self._max_spans = max_spans_per_record
        self._max_record_bytes = max_record_bytes
        self._wave_bytes = 4 * batch_bytes
        self._max_buffered = max_buffered_bytes
        self._request_timeout_s = request_timeout_ms / 1000
        self._probe_interval_s = probe_interval_s
        self._exit_timeout_s = exit_timeout_s
        self._encoder = SpanBatchEncoder()
        self._codec = AvroCodec()
        self._partitioner = DefaultPartitioner()
        self._partitions: dict[bytes, int] = {}
        self._partition_list: list[int] = []

        # Held by the loop while it encodes a wave, and passed through by every publish() call: numpy
        # releases the GIL for each array operation, and without this a thread that keeps publishing
        # would take the GIL back every time and starve the encoding (a GIL convoy: 5 ms per operation).
        self._encoding = threading.Lock()

        # Shared with publishing threads, under _lock.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # buffer space freed, spans settled, closing
        self._pending: deque[tuple[int, str, PreparedSpan | bytes, int]] = deque()  # seq, rollout, payload, bytes
        self._pending_bytes = 0
        self._first_pending_at = 0.0
        self._buffered = 0  # pending + taken but not yet acknowledged or journaled
        self._seq = 0  # of the last publish() call
        self._taken_seq = 0  # of the last item the loop has taken
        self._settled_seq = 0  # every call up to this one is acknowledged or journaled
        self._flush_seq = 0  # a flush() waits for this one
        self._closing = False
        self._close_deadline = 0.0
        self._counts = dict.fromkeys(("spans_published", "events_published", "spans_journaled", "records_journaled",
                                      "records_replayed", "spans_replayed", "records_dropped"), 0)

        # Owned by the loop thread.
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._closing_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._producer: AIOKafkaProducer | None = None
        self._journal: Journal | None = None
        self._state = _State.CONNECTED
        self._carry: list[_Record] = []  # taken but did not fit this wave's producer batches
        self._replay_head: list[_Record] = []  # read from the journal, not yet acknowledged
        self._replay_used = 0
        self._replayed = [0, 0]  # records, spans since the outage began
        self._probe: asyncio.Task | None = None

    # --- the caller's side -------------------------------------------------------------------

    def start(self) -> Self:
        """Start the background loop and connect; an unreachable broker is not an error (spans are journaled)."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._thread_main, name=f"agentstream-publisher-{self.topic}",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise PublisherError(f"publisher could not start: {self._startup_error}") from self._startup_error
        _exit_hooks.add(self)
        return self

    def publish(self, span: Mapping[str, Any]) -> None:
        """Queue one Span record (a dict as in schemas/avro/span.avsc); raises EncodeError at once if it does not fit.

        It returns at once, unless `max_buffered_bytes` of spans already wait for the broker (then
        it waits for room: bounded memory) or the background thread is encoding a wave (a few ms).
        """
        prepared = prepare_span(span)
        self._enqueue(span["rollout_id"], prepared, prepared[5])

    def publish_event(self, event: Mapping[str, Any]) -> None:
        """Queue one RolloutEvent record; it lands after every span of its rollout published before it."""
        value = self._codec.encode(ROLLOUT_EVENT, event)
        self._enqueue(event["rollout_id"], value, len(value))

    async def publish_async(self, span: Mapping[str, Any]) -> None:
        """publish() for coroutines: waits for buffer space without blocking the caller's event loop."""
        prepared = prepare_span(span)
        if not self._try_enqueue(span["rollout_id"], prepared, prepared[5]):
            await asyncio.to_thread(self._enqueue, span["rollout_id"], prepared, prepared[5])

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every span published before this call is acknowledged by the broker or journaled."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            target = self._seq
            if self._settled_seq >= target:
                return
            self._flush_seq = max(self._flush_seq, target)
        self._wake()
        with self._lock:
            while self._settled_seq < target:
                left = deadline - time.monotonic()
                if self._thread is None or not self._thread.is_alive():
                    raise PublisherClosed("the publisher stopped before the flush finished")
                if left <= 0:
                    raise FlushTimeout(f"{target - self._settled_seq} publish calls not yet acknowledged or "
                                       f"journaled after {timeout_s:g}s")
                self._changed.wait(left)

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, then stop; whatever the broker has not acknowledged within `timeout_s` goes to the journal."""
        timeout = self._exit_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            thread, first = self._thread, not self._closing
            if first:
                self._closing = True
                self._close_deadline = time.monotonic() + timeout
            self._changed.notify_all()
        if thread is None:
            return
        if first:
            self._call_in_loop(lambda: (self._closing_event.set(), self._wakeup.set()))
        thread.join(timeout + self._request_timeout_s + 5)
        if thread.is_alive():
            log.error("span publisher for %s did not stop in time; %d buffered bytes of spans may be lost",
                      self.topic, self._buffered)
        _exit_hooks.discard(self)

    def stats(self) -> PublisherStats:
        """A snapshot of the counters."""
        with self._lock:
            state = "closed" if self._closing and not (self._thread and self._thread.is_alive()) else self._state.value
            return PublisherStats(**self._counts, buffered_bytes=self._buffered, state=state)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _enqueue(self, rollout_id: str, payload: PreparedSpan | bytes, nbytes: int) -> None:
        if self._encoding.locked():  # wait here while the loop encodes a wave (see __init__)
            with self._encoding:
                pass
        with self._lock:
            while self._buffered and self._buffered + nbytes > self._max_buffered and not self._closing:
                self._changed.wait()
            self._append(rollout_id, payload, nbytes)

    def _try_enqueue(self, rollout_id: str, payload: PreparedSpan | bytes, nbytes: int) -> bool:
        if self._encoding.locked():
            with self._encoding:
                pass
        with self._lock:
            if self._buffered and self._buffered + nbytes > self._max_buffered and not self._closing:
                return False
            self._append(rollout_id, payload, nbytes)
            return True

    def _append(self, rollout_id: str, payload: PreparedSpan | bytes, nbytes: int) -> None:
        """Queue one item; the caller holds the lock."""
        if self._closing or self._loop is None:
            raise PublisherClosed(f"span publisher for {self.topic} is {'closed' if self._closing else 'not started'}")
        self._seq += 1
        self._pending.append((self._seq, rollout_id, payload, nbytes))
        self._buffered += nbytes
        self._pending_bytes += nbytes
        if len(self._pending) == 1:
            self._first_pending_at = time.monotonic()
            self._loop.call_soon_threadsafe(self._wakeup.set)
        elif self._pending_bytes >= self._wave_bytes > self._pending_bytes - nbytes:
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def _wake(self) -> None:
        self._call_in_loop(lambda: self._wakeup.set())

    def _call_in_loop(self, callback: Any) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(callback)
            except RuntimeError:  # the loop has stopped
                pass

    # --- the loop's side ---------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(self._main())
        except BaseException as error:
            log.exception("span publisher for %s stopped on an unexpected error", self.topic)
            self._startup_error = self._startup_error or error
        finally:
            with self._lock:
                self._closing = True
                self._changed.notify_all()
            self._ready.set()

    async def _main(self) -> None:
        try:
            self._journal = Journal(self._journal_dir, self.topic)
            self._wakeup, self._closing_event = asyncio.Event(), asyncio.Event()
            self._loop = asyncio.get_running_loop()
        except BaseException as error:
            self._startup_error = error
            raise
        try:
            connected = await self._start_producer()
            if not connected:
                await self._enter_outage("cannot connect")
            elif not self._journal.empty:
                log.info("replaying spans journaled by an earlier run from %s", self._journal.directory)
                self._state = _State.REPLAYING
            self._ready.set()
            await self._serve()
        finally:
            await self._shutdown()

    async def _serve(self) -> None:
        while True:
            await self._wait_for_work()
            if self._closing and (self._state is not _State.CONNECTED or time.monotonic() >= self._close_deadline):
                self._journal_wave(self._carry + self._build_records(self._take(None)))
                self._carry = []
                return
            if self._state is _State.REPLAYING:
                await self._replay_some()
                if self._state is _State.REPLAYING and (self._pending_bytes >= self._max_buffered // 2
                                                        or self._flush_seq > self._settled_seq):
                    self._journal_wave(self._build_records(self._take(None)))
            else:
                records = self._carry + self._build_records(self._take(self._wave_bytes))
                self._carry = []
                if self._state is _State.CONNECTED:
                    await self._send_wave(records)
                else:
                    self._journal_wave(records)
            if self._closing and not self._pending and not self._carry:
                return

    async def _wait_for_work(self) -> None:
        """Until a wave is due: linger elapsed, a full wave queued, a flush or close asked, or a journal to replay."""
        while True:
            self._wakeup.clear()
            with self._lock:
                if (self._closing or self._carry or self._state is _State.REPLAYING
                        or self._pending_bytes >= self._wave_bytes
                        or (self._pending and self._flush_seq > self._settled_seq)):
                    return
                linger = self._first_pending_at + self._linger_s - time.monotonic() if self._pending else None
            if linger is not None and linger <= 0:
                return
            try:
                await asyncio.wait_for(self._wakeup.wait(), linger)
            except TimeoutError:
                return

    def _take(self, max_bytes: int | None) -> list[tuple[int, str, PreparedSpan | bytes, int]]:
        """The oldest queued items, up to `max_bytes` of them (at least one), or all when None."""
        with self._lock:
            if max_bytes is None or self._pending_bytes <= max_bytes:
                items, self._pending = list(self._pending), deque()
                self._pending_bytes = 0
            else:
                items, taken = [], 0
                while self._pending and taken < max_bytes:
                    items.append(self._pending.popleft())
                    taken += items[-1][3]
                self._pending_bytes -= taken
            if items:
                self._taken_seq = items[-1][0]
            return items

    def _build_records(self, items: list[tuple[int, str, PreparedSpan | bytes, int]]) -> list[_Record]:
        """Group queued spans per rollout into SpanBatch records, in order with the rollout's events."""
        order: list[_Run | _Record] = []
        open_runs: dict[str, _Run] = {}
        for seq, rollout_id, payload, nbytes in items:
            if type(payload) is bytes:  # a RolloutEvent closes the rollout's run: later spans go after it
                open_runs.pop(rollout_id, None)
                order.append(_Record(rollout_id.encode(), payload, 0, seq, nbytes))
                continue
            run = open_runs.get(rollout_id)
            if run is None or len(run.spans) >= self._max_spans or run.nbytes >= self._max_record_bytes:
                run = open_runs[rollout_id] = _Run(rollout_id, seq)
                order.append(run)
            run.spans.append(payload)
            run.nbytes += nbytes
        with self._encoding:
            values = iter(self._encoder.encode_batches([entry.spans for entry in order if type(entry) is _Run]))
        return [entry if type(entry) is _Record
                else _Record(entry.rollout_id.encode(), next(values), len(entry.spans), entry.first_seq, entry.nbytes)
                for entry in order]

    async def _send_wave(self, records: list[_Record]) -> None:
        """Send fresh records; the acknowledged are settled, the rest carried, journaled or dropped."""
        delivered, carried, failed, error = await self._deliver(records)
        self._count("spans_published", sum(r.spans for r in delivered))
        self._count("events_published", sum(1 for r in delivered if not r.spans))
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
            self._count("records_replayed", len(delivered))
            self._count("spans_replayed", sum(r.spans for r in delivered))
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
            self._state = _State.CONNECTED

    async def _deliver(self, records: list[_Record]) -> tuple[list[_Record], list[_Record], list[_Record],
                                                               BaseException | None]:
        """Put one producer batch per partition on the wire and wait for the broker's answers.

        Returns the acknowledged records, those that did not fit their partition's batch (to go
        first in the next wave), those that failed, and the first error.
        """
        delivered: list[_Record] = []
        carried: list[_Record] = []
        failed: list[_Record] = []
        error: BaseException | None = None
        sent: dict[asyncio.Future, list[_Record]] = {}
        try:
            producer = self._producer
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
            problem = gave_up if future in unanswered else future.exception()
            if problem is None:
                delivered += members
            else:
                failed += members
                error = error or problem
        return delivered, carried, failed, error

    def _fill_batches(self, producer: AIOKafkaProducer, records: list[_Record],
                      partitions: list[int]) -> tuple[dict[int, tuple[Any, list[_Record]]], list[_Record]]:
        """At most one producer batch per partition, filled in order; the records that do not fit are carried."""
        batches: dict[int, tuple[Any, list[_Record]]] = {}
        carried: list[_Record] = []
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
        a probe interval: faster and quieter than aiokafka's retries until its request timeout) and,
        once the publisher is closing, at the close deadline.
        """
        waiting = set(futures)
        closing = asyncio.ensure_future(self._closing_event.wait())
        try:
            while waiting and not closing.done():
                done, _ = await asyncio.wait(waiting | {closing}, timeout=self._probe_interval_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                waiting = {future for future in waiting if not future.done()}
                if waiting and not done and not await _port_open(self.bootstrap_servers):
                    return waiting, KafkaConnectionError(f"cannot connect to {self.bootstrap_servers}")
            if waiting:
                _, waiting = await asyncio.wait(waiting, timeout=max(0.0, self._close_deadline - time.monotonic()))
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

    def _journal_wave(self, records: list[_Record]) -> None:
        """Append records to the journal (after everything in it) and settle them."""
        if not records:
            return
        try:
            self._journal.append(records)
        except OSError as error:
            self._drop(records, error)
            return
        self._count("records_journaled", len(records))
        self._count("spans_journaled", sum(r.spans for r in records))
        self._settle(records)

    def _drop(self, records: list[_Record], error: BaseException) -> None:
        if records:
            log.error("dropped %d records (%d spans) for %s: %r", len(records), sum(r.spans for r in records),
                      self.topic, error)
            self._count("records_dropped", len(records))
            self._settle(records)

    def _settle(self, records: list[_Record]) -> None:
        """Give back the buffer space of records that are acknowledged, journaled or dropped; wake waiters."""
        released = sum(r.nbytes for r in records)
        with self._lock:
            self._buffered -= released
            oldest_open = min((r.first_seq for r in self._carry if r.first_seq >= 0), default=self._taken_seq + 1)
            self._settled_seq = max(self._settled_seq, oldest_open - 1)
            self._changed.notify_all()

    def _count(self, name: str, amount: int) -> None:
        if amount:
            with self._lock:
                self._counts[name] += amount

    async def _enter_outage(self, error: BaseException | str) -> None:
        self._state = _State.JOURNALING
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
        producer._closed = True  # it will never flush: no "unclosed producer" warning for it
        try:
            await asyncio.wait_for(producer._sender.close(), self._request_timeout_s)
            await producer.client.close()
        except (TimeoutError, KafkaError, OSError) as problem:
            log.debug("abandoned Kafka producer did not stop cleanly: %r", problem)

    async def _watch_broker(self) -> None:
        """Probe the broker until it answers and has the topic, then switch to replaying the journal."""
        while self._state is _State.JOURNALING and not self._closing:
            await asyncio.sleep(self._probe_interval_s)
            if await self._broker_answers():
                self._state = _State.REPLAYING
                self._wakeup.set()

    async def _broker_answers(self) -> bool:
        if not await _port_open(self.bootstrap_servers):  # quiet, unlike a failing Kafka client
            return False
        if self._producer is None and not await self._start_producer():
            return False
        try:
            metadata = await asyncio.wait_for(self._producer.client.fetch_all_metadata(), self._request_timeout_s)
            if self.topic not in metadata.topics():
                return False
            await asyncio.wait_for(self._producer.client.force_metadata_update(), self._request_timeout_s)
        except (TimeoutError, KafkaError, OSError):
            return False
        return True

    async def _start_producer(self) -> bool:
        producer = AIOKafkaProducer(**self._producer_options)
        try:
            await producer.start()
        except (TimeoutError, KafkaError, OSError):
            await producer.stop()
            return False
        self._producer = producer
        return True

    async def _shutdown(self) -> None:
        with self._lock:
            self._closing = True  # also when the loop stops on an error: publish() refuses from now on
        leftovers = self._carry + self._build_records(self._take(None))
        if leftovers and self._journal is not None:  # only after an unexpected error
            self._journal_wave(leftovers)
        if self._probe is not None:
            self._probe.cancel()
        if self._producer is not None:
            try:
                await asyncio.wait_for(self._producer.stop(), max(1.0, self._close_deadline - time.monotonic()))
            except (TimeoutError, KafkaError, OSError) as error:
                log.warning("span publisher for %s: the Kafka producer did not stop cleanly: %r", self.topic, error)
        if self._journal is not None:
            if not self._journal.empty:
                log.warning("spans for %s stay journaled in %s; the next publisher started on that directory "
                            "replays them", self.topic, self._journal.directory)
            self._journal.close()


def _unreachable(error: BaseException) -> bool:
    """True for errors that mean the broker cannot be reached now (worth journaling), not a refused record."""
    return isinstance(error, (KafkaTimeoutError, asyncio.TimeoutError, OSError)) or getattr(error, "retriable", False)


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


class _ExitHooks:
    """Closes every running publisher at interpreter exit and on SIGTERM, so spans in memory are not lost."""

    def __init__(self) -> None:
        self._publishers: set[SpanPublisher] = set()
        self._lock = threading.Lock()
        self._atexit = False
        self._sigterm = False

    def add(self, publisher: SpanPublisher) -> None:
        with self._lock:
            self._publishers.add(publisher)
            if not self._atexit:
                atexit.register(self.close_all)
                self._atexit = True
            # Only where nobody else handles SIGTERM, and only the main thread may install handlers.
            if (not self._sigterm and threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
                signal.signal(signal.SIGTERM, self._on_sigterm)
                self._sigterm = True

    def discard(self, publisher: SpanPublisher) -> None:
        with self._lock:
            self._publishers.discard(publisher)

    def close_all(self) -> None:
        with self._lock:
            publishers = list(self._publishers)
        for publisher in publishers:
            publisher.close()

    def _on_sigterm(self, signum: int, frame: object) -> None:
        """Flush in a thread (the interrupted code may hold a publisher's lock), then die of SIGTERM as before."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        if self._publishers:
            log.warning("SIGTERM: flushing %d span publisher(s) before exiting", len(self._publishers))

        def flush_then_terminate() -> None:
            self.close_all()
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=flush_then_terminate, name="agentstream-sigterm").start()


_exit_hooks = _ExitHooks()

"""The public face of the publisher: :class:`SpanPublisher`, what callers in any thread use to publish.

A :class:`SpanPublisher` owns an aiokafka producer running on its own uvloop event loop in a
background thread (:mod:`agentstream.pipeline.publisher.sender`). ``publish`` checks and mostly encodes a
span in the caller's thread (``agentstream.schemas.span_writer``) and queues it in the
:mod:`~pipeline.publisher.accumulator`; the loop sends the queue in waves, in order per rollout.
While the broker is unreachable, spans go to an append-only
:class:`~pipeline.publisher.journal.Journal` on local disk and are replayed in order once it is
back (also by a publisher that closes just after the broker came back, within its close
deadline); a journal left by a crashed process is replayed by the next publisher started on the
same directory. Spans still in memory are flushed when the interpreter exits and on SIGTERM
(:mod:`~pipeline.publisher.exit_hooks`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from agentstream.infra.config import Config
from agentstream.infra.kafka import topic_name
from agentstream.pipeline.publisher import exit_hooks
from agentstream.pipeline.publisher.accumulator import Accumulator
from agentstream.pipeline.publisher.errors import PublisherFull
from agentstream.pipeline.publisher.sender import SenderSettings, SenderThread
from agentstream.schemas import ROLLOUT_EVENT, AvroCodec, EncodeError
from agentstream.schemas.records import RolloutEventRecord, SpanRecord
from agentstream.schemas.span_writer import NBYTES, PreparedSpan, prepare_span

log = logging.getLogger(__name__)


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
    journal_write_failures: int
    """Journal appends the disk refused (full, read-only): their records were held in memory, not dropped."""
    buffered_bytes: int
    state: str


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
        self._request_timeout_s = request_timeout_ms / 1000
        self._exit_timeout_s = exit_timeout_s
        self._codec = AvroCodec()
        settings = SenderSettings.create(config.kafka, self.topic, bootstrap_servers, journal_dir=journal_dir,
                                         batch_bytes=batch_bytes, request_timeout_ms=request_timeout_ms,
                                         probe_interval_s=probe_interval_s)
        self._queue = Accumulator(self.topic, linger_s=linger_ms / 1000, wave_bytes=settings.wave_bytes,
                                  max_buffered=max_buffered_bytes, max_spans_per_record=max_spans_per_record,
                                  max_record_bytes=max_record_bytes)
        self._sender = SenderThread(self._queue, settings)

    def start(self) -> Self:
        """Start the background loop and connect; an unreachable broker is not an error (spans are journaled)."""
        if self._sender.started:
            return self
        self._sender.start()
        exit_hooks.register(self)
        return self

    def publish(self, span: SpanRecord) -> None:
        """Queue one Span record (a dict as in schemas/avro/span.avsc); raises EncodeError at once if it does not fit.

        It returns at once, unless `max_buffered_bytes` of spans already wait for the broker (then
        it waits for room: bounded memory) or the background thread is encoding a wave (a few ms).
        """
        prepared = prepare_span(span)
        self._queue.enqueue(span["rollout_id"], prepared, prepared[NBYTES])

    def publish_event(self, event: RolloutEventRecord) -> None:
        """Queue one RolloutEvent record; it lands after every span of its rollout published before it."""
        value = self._codec.encode(ROLLOUT_EVENT, event)
        self._queue.enqueue(event["rollout_id"], value, len(value))

    async def publish_async(self, span: SpanRecord) -> None:
        """publish() for coroutines: waits for buffer space without blocking the caller's event loop."""
        prepared = prepare_span(span)
        if not self._queue.try_enqueue(span["rollout_id"], prepared, prepared[NBYTES]):
            await asyncio.to_thread(self._queue.enqueue, span["rollout_id"], prepared, prepared[NBYTES])

    @property
    def saturated(self) -> bool:
        """True while three quarters of `max_buffered_bytes` wait for the broker (or a disk to journal them on).

        A server answers new work "retry later" then, keeping the last quarter for the spans of work in flight.
        """
        return self._queue.buffered * 4 >= self._queue.max_buffered * 3

    def offer(self, spans: Sequence[SpanRecord], events: Sequence[RolloutEventRecord] = ()
              ) -> list[tuple[SpanRecord, EncodeError]]:
        """Queue these spans, then these RolloutEvents, all together if the buffer has room for them now; never waits.

        For servers that answer "retry later" rather than hold a request: raises PublisherFull, with
        nothing queued, while `max_buffered_bytes` wait for the broker (PublisherClosed once closed).
        Spans that do not fit the Span schema are left out and returned with their EncodeError.
        """
        items: list[tuple[str, PreparedSpan | bytes, int]] = []
        refused: list[tuple[SpanRecord, EncodeError]] = []
        for span in spans:
            try:
                prepared = prepare_span(span)
            except EncodeError as error:
                refused.append((span, error))
                continue
            items.append((span["rollout_id"], prepared, prepared[NBYTES]))
        for event in events:
            value = self._codec.encode(ROLLOUT_EVENT, event)
            items.append((event["rollout_id"], value, len(value)))
        if items:
            buffered = self._queue.try_enqueue_all(items)
            if buffered:
                raise PublisherFull(sum(nbytes for _, _, nbytes in items), buffered, self._queue.max_buffered,
                                    self._sender.state_name(False))
        return refused

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every span published before this call is acknowledged by the broker or journaled."""
        deadline = time.monotonic() + timeout_s
        target = self._queue.request_flush()
        if target is None:
            return
        self._sender.wake()
        self._queue.wait_settled(target, deadline, timeout_s, self._sender.is_alive)

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, then stop; whatever the broker has not acknowledged within `timeout_s` goes to the journal."""
        timeout = self._exit_timeout_s if timeout_s is None else timeout_s
        first = self._queue.begin_close(timeout)
        if not self._sender.started:
            return
        if first:
            self._sender.stop()
        if not self._sender.join(timeout + self._request_timeout_s + 5):
            log.error("span publisher for %s did not stop in time; %d buffered bytes of spans may be lost",
                      self.topic, self._queue.buffered)
        exit_hooks.unregister(self)

    def stats(self) -> PublisherStats:
        """A snapshot of the counters."""
        counts, buffered, state = self._queue.snapshot(self._sender.state_name)
        return PublisherStats(**counts, buffered_bytes=buffered, state=state)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def process_publisher(config: Config, bootstrap_servers: str, component: str) -> SpanPublisher:
    """The span publisher of one of agentstream's processes; its journal is ``<stack home>/journal/<component>``."""
    return SpanPublisher(config, bootstrap_servers, journal_dir=config.stack.home.resolve() / "journal" / component)

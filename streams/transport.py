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

Both reach into faust and aiokafka internals, only through :mod:`streams.dependency_adapters`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import aiokafka
from faust.transport.drivers.aiokafka import Transport
from faust.types import TP, AppT

from streams.dependency_adapters import (
    HookedConsumer,
    WorkerConsumerThread,
    acked_offsets,
    set_fetch_max_wait,
    unacked_offsets,
)

if TYPE_CHECKING:
    from yarl import URL  # faust's broker URLs


class _ConsumerThread(WorkerConsumerThread):
    def configure_worker_consumer(self, consumer: aiokafka.AIOKafkaConsumer, transport: Transport) -> None:
        set_fetch_max_wait(consumer, cast(StreamsTransport, transport).fetch_max_wait_ms)


class _Consumer(HookedConsumer):
    consumer_thread = _ConsumerThread

    def commit_offset(self, tp: TP) -> int | None:
        held = unacked_offsets(self, tp)
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

    Consumer = _Consumer

    def __init__(self, url: list[URL], app: AppT, fetch_max_wait_ms: int, **kwargs: Any) -> None:
        super().__init__(url, app, **kwargs)
        self.fetch_max_wait_ms = fetch_max_wait_ms

"""Every private member of faust-streaming and aiokafka that the stream processors use, in one place.

Written against faust-streaming 0.15.3 with aiokafka 0.14 (pinned in pyproject.toml). Neither
library lets a worker set its consumer's fetch wait or bound how far a commit goes, and
:mod:`agentstream.streams.transport` needs both (its docstring says why). So it goes through the functions
and the two hook classes here, and nothing else in ``streams/`` names a private member of
either library. Each one below names the upstream member it relies on and what that member
does in the pinned version.

``tests/unit/streams/test_dependency_adapters.py`` checks the installed libraries against this
list (no broker needed). When it fails after an upgrade, read the upstream code of the member
it names, adapt this module (and only it), then move the pins and the versions below.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import aiokafka
from aiokafka.errors import KafkaError
from faust.tables.manager import TableManager
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread, Consumer, Transport
from faust.types import TP

FAUST_VERSION = "0.15.3"
AIOKAFKA_SERIES = "0.14"


def set_fetch_max_wait(consumer: aiokafka.AIOKafkaConsumer, fetch_max_wait_ms: int) -> None:
    """Set how long the broker may hold a fetch, on a consumer that has not started.

    aiokafka: ``AIOKafkaConsumer.__init__`` keeps ``fetch_max_wait_ms`` in ``_fetch_max_wait_ms``,
    which ``start()`` hands to the Fetcher it creates; there is no public setter.
    """
    consumer._fetch_max_wait_ms = fetch_max_wait_ms


def acked_offsets(consumer: Consumer, tp: TP) -> list[int]:
    """``tp``'s acknowledged offsets not committed yet: faust's own list, edited in place to change what it commits.

    faust: ``Consumer._acked`` (a defaultdict of lists by TP), which ``ack`` appends to and
    ``_new_offset`` reads, sorts and consumes up to the first gap.
    """
    return consumer._acked[tp]


def read_offset(consumer: Consumer, tp: TP) -> int | None:
    """faust's read offset of ``tp``: the committed offset right after a seek, then the last offset read.

    faust: ``Consumer._read_offset`` (a defaultdict of ``None`` by TP), which ``seek`` and
    ``perform_seek`` set and ``_drain_messages`` both reads and advances: it drops every
    message below it without a word (``DROPPED MESSAGE``, a debug line).
    """
    return consumer._read_offset[tp]


def forget_offsets(consumer: Consumer, tp: TP) -> None:
    """Drop what faust remembers of ``tp``'s positions (read, committed, acknowledged, gaps), as after a revoke.

    faust: ``Consumer._read_offset``, ``_committed_offset`` (a commit must go beyond it),
    ``_acked``, ``_acked_index`` and ``_gap``, the per-TP structures ``on_partitions_revoked``
    pops; here they are emptied while ``tp`` stays assigned (its log was reset).
    """
    consumer._read_offset[tp] = None
    consumer._committed_offset[tp] = None
    consumer._acked[tp] = []
    consumer._acked_index[tp] = set()
    consumer._gap.pop(tp, None)


def unacked_messages(consumer: Consumer, tp: TP) -> list:
    """``tp``'s messages delivered to a stream and not acknowledged yet (held ones among them).

    faust: ``Consumer._unacked_messages``, the set of messages ``track_message`` added and
    ``ack`` has not discarded yet.
    """
    return [message for message in consumer._unacked_messages if message.tp == tp]


def drop_unacked(consumer: Consumer, message) -> None:
    """Mark ``message`` acknowledged without counting its offset (faust: ``Message.acked``, ``_unacked_messages``)."""
    message.acked = True
    consumer._unacked_messages.discard(message)


def kafka_consumer(consumer: object) -> aiokafka.AIOKafkaConsumer | None:
    """The aiokafka consumer under faust's, once its thread has created it (for its group member id).

    faust: ``ThreadDelegateConsumer._thread`` is the ``AIOKafkaConsumerThread``, which keeps the
    consumer it created in ``_consumer`` (None before).
    """
    found = getattr(getattr(consumer, "_thread", None), "_consumer", None)
    return found if isinstance(found, aiokafka.AIOKafkaConsumer) else None


GROUP_ERROR_CHECK_S = 0.5
"""How often the worker's consumer thread looks for a fatal error of its group coordinator."""


class WorkerConsumerThread(AIOKafkaConsumerThread):
    """faust's aiokafka consumer thread, with a public hook on the worker's AIOKafkaConsumer before it starts, and
    the group coordinator's fatal errors turned into a crash of the worker.

    faust: ``AIOKafkaConsumerThread._create_worker_consumer(transport)`` builds that consumer
    (with ``fetch_max_wait_ms=1500`` written in) when the app is a worker; ``on_start`` starts it on the
    thread's loop. aiokafka: a join the coordinator refuses for good (GroupAuthorizationFailedError,
    InvalidSessionTimeoutError) is kept for the next ``getmany`` by ``consumer._coordinator.check_errors()``;
    faust reads the fetcher directly and never calls it, so without the check here the worker waited forever.
    """

    _group_errors: asyncio.Task | None = None

    async def on_start(self) -> None:
        await super().on_start()
        self._group_errors = asyncio.ensure_future(self._crash_on_group_error(self._ensure_consumer()))

    async def on_thread_stop(self) -> None:
        if self._group_errors is not None:
            self._group_errors.cancel()
        await super().on_thread_stop()

    async def _crash_on_group_error(self, consumer: aiokafka.AIOKafkaConsumer) -> None:
        """Crash the worker (faust stops it; ``crash_reason`` holds the error) once the coordinator reports one."""
        while True:
            await asyncio.sleep(GROUP_ERROR_CHECK_S)
            try:
                consumer._coordinator.check_errors()
            except KafkaError as error:
                await self.crash(error)
                return

    def _create_worker_consumer(self, transport: Transport) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        self.configure_worker_consumer(consumer, transport)
        return consumer

    def configure_worker_consumer(self, consumer: aiokafka.AIOKafkaConsumer, transport: Transport) -> None:
        """Adjust the worker's consumer before faust starts it (nothing, unless a subclass says otherwise)."""


class HookedConsumer(Consumer):
    """faust's aiokafka consumer, with its thread class and the offset of its next commit as public hooks.

    faust: ``Consumer._new_consumer_thread()`` creates the thread (``AIOKafkaConsumerThread(self,
    loop=self.loop, beacon=self.beacon)``); ``Consumer._new_offset(tp)`` says where a commit of
    ``tp`` goes (None: no commit), consuming the acknowledged offsets below it.
    """

    consumer_thread: ClassVar[type[AIOKafkaConsumerThread]] = AIOKafkaConsumerThread

    def _new_consumer_thread(self) -> AIOKafkaConsumerThread:
        return self.consumer_thread(self, loop=self.loop, beacon=self.beacon)

    def _new_offset(self, tp: TP) -> int | None:
        return self.commit_offset(tp)

    def commit_offset(self, tp: TP) -> int | None:
        """The offset a commit of ``tp`` goes to, or None; faust's answer unless a subclass says otherwise."""
        return super()._new_offset(tp)


class PromptTableManager(TableManager):
    """faust's table manager without the fixed second it waits at start: a restarted worker reads a second sooner.

    faust: ``TableManager.on_start`` sleeps 1.0 s, then runs ``_update_channels()`` (marks the
    tables final and starts their changelog channels) and starts ``recovery``, which subscribes
    and waits for the first assignment. The pause lets tables declared late register; this app
    declares none, so it only delayed the worker's first record after every start.
    """

    async def on_start(self) -> None:
        if not self.should_stop:
            await self._update_channels()
            await self.recovery.start()

"""The faust-streaming worker: two agents (spans, groups) wired to their processors, plus timers.

Each agent is a function from its input topic to output topics; the processors hold the
logic and the state. An agent reads a batch and applies it to the state (under the lock the
timers' ticks share), then queues it for storing: a task of its own writes it to ClickHouse
while the agent goes on with the next one, so a rollout's end event is not kept waiting
behind the insert of the spans before it. Offsets follow faust's acknowledgements: a record
is acknowledged once its batch is stored and nothing holds it any more (a processor holds the
first record of every open rollout or pending group until what they started is written out).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Set as AbstractSet
from typing import Any

import faust
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import GroupAuthorizationFailedError, InvalidSessionTimeoutError, KafkaError
from faust.types import TP
from mode.supervisors import CrashingSupervisor

from agentstream.infra.config import Config, KafkaConfig
from agentstream.infra.grace import ShutdownDeadline
from agentstream.infra.kafka import (
    AUTHORIZATION_ERRORS,
    KafkaSetupError,
    TopicSpec,
    access_denied,
    check_topic_access,
    client_options,
    create_topics,
    named_refusals,
    session_timeout_refused,
    start_producer,
    topic_name,
)
from agentstream.infra.members import MemberLedger, evict_dead_members, member_id
from agentstream.streams.clickhouse_io import Warehouse
from agentstream.streams.dependency_adapters import PromptTableManager, kafka_consumer
from agentstream.streams.groups import GroupProcessor
from agentstream.streams.processor import SpanProcessor
from agentstream.streams.records import RawRecord
from agentstream.streams.sink import CompletionSink, gather
from agentstream.streams.stage import Stage
from agentstream.streams.transport import StreamsConsumer, StreamsTransport

log = logging.getLogger("agentstream.streams")

COORDINATOR_WAIT_S = 15.0
"""How long the worker's first question for its group coordinator may go unanswered (not yet available)."""
INGEST_QUEUE_BYTES = 64 << 20
"""Record bytes an agent may have read but not yet stored before it waits (a few seconds of full-speed ingest)."""
CYCLE_COLLECTION_S = 60.0
"""How often the worker runs the cycle collector over all its objects (streams/main.py makes the collector's own
runs rare; see there)."""


class KafkaEmitter:
    """Output records through one aiokafka producer, started on the worker's loop at first use."""

    def __init__(self, kafka: KafkaConfig, options: dict) -> None:
        self.kafka, self.options = kafka, options
        self._producer: AIOKafkaProducer | None = None
        self._pending: list[asyncio.Future] = []

    async def _started(self) -> AIOKafkaProducer:
        if self._producer is None:
            self._producer = await start_producer(self.kafka, self.options, linger_ms=5, max_batch_size=1 << 20,
                                                  max_request_size=16 << 20)
        return self._producer

    async def send(self, topic: str, key: bytes | None, value: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> None:
        producer = await self._started()
        self._pending.append(await producer.send(topic, value=value, key=key, headers=headers))

    async def flush(self) -> None:
        """Wait until every record sent so far is acknowledged (raises if the broker refused one)."""
        pending, self._pending = self._pending, []
        if pending:
            await asyncio.gather(*pending)

    async def stop(self) -> None:
        if self._producer is not None:
            await self.flush()
            await self._producer.stop()


class Ingestion:
    """Stores an agent's batches on its own task, those of ``interval_s`` together; each record stays held until stored.

    Fewer, larger inserts spare ClickHouse a part (and its merges) per batch. The queue is bounded
    by the bytes it holds, not by a count of batches: a count short enough to stop a worker soon
    when ClickHouse is slow or down (4 batches) made the agent wait on every insert in normal
    operation too, and the rollout ends behind it waited with it (transition latency p50 380 ms
    at 0.25 s between inserts, 460 ms at 0.5 s; 350 ms either way when the agent does not wait).
    """

    def __init__(self, processor: Stage[Any], holder: FaustHolder, interval_s: float,
                 max_bytes: int = INGEST_QUEUE_BYTES) -> None:
        self.processor = processor
        self.holder = holder
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self.queue: asyncio.Queue = asyncio.Queue()  # bounded by put(), in bytes
        self.queued_bytes = 0
        self.room = asyncio.Event()
        self.room.set()

    async def put(self, records: list[RawRecord], batch: Any, published_at: float | None = None) -> None:
        """Queue a read batch for storing; waits while the batches queued hold ``max_bytes`` or more.

        ``published_at`` (time.time() of the oldest record's publishing) lets a backlog read after
        a restart be stored at once: its records waited out the interval before they were read.
        """
        while self.queued_bytes >= self.max_bytes:
            self.room.clear()
            await self.room.wait()
        for record in records:
            self.holder.hold(record)
        size = sum(len(record.value or b"") for record in records)
        self.queued_bytes += size
        self.queue.put_nowait((records, batch, size, time.time() if published_at is None else published_at))

    async def run(self) -> None:
        while True:
            queued = await gather(self.queue, self.interval_s, waited=lambda item: max(0.0, time.time() - item[3]))
            await self.processor.ingest([batch for _, batch, _, _ in queued])
            for records, _, size, _ in queued:
                for record in records:
                    self.holder.release(record)
                self.queued_bytes -= size
            self.room.set()


class FaustHolder:
    """Hold = one more reference on the faust message; release = drop it, letting faust commit past it."""

    def hold(self, record: RawRecord) -> None:
        record.handle.message.incref()

    def release(self, record: RawRecord) -> None:
        record.handle.ack()


def internal_topics(config: Config) -> list[TopicSpec]:
    name = topic_name(config.topics, "streams.groups")
    return [TopicSpec("streams.groups", name, config.topics.partitions,
                      {"cleanup.policy": "delete", "retention.ms": str(config.topics.retention_ms)})]


async def prepare_topics(config: Config, bootstrap_servers: str) -> None:
    await create_topics(config, bootstrap_servers, internal_topics(config))


def worker_operation(config: Config) -> str:
    """What the worker does with Kafka, for the line that names a refusal."""
    return (f"the streams worker (reading {topic_name(config.topics, 'spans')} in group {config.streams.app_id}, "
            f"writing transitions and dlq)")


async def find_coordinator(admin: AIOKafkaAdminClient, group: str, timeout_s: float = COORDINATOR_WAIT_S) -> None:
    """Ask for ``group``'s coordinator, which Kafka answers only to a principal allowed to describe the group;
    retried while it is not available yet (a fresh cluster creates its offsets topic at the first such question)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await admin.find_coordinator(group)
            return
        except GroupAuthorizationFailedError as error:  # aiokafka's argument is a sentence; the line names the group
            raise GroupAuthorizationFailedError(group) from error
        except KafkaError as error:
            if not error.retriable or asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def check_access(config: Config, bootstrap_servers: str) -> None:
    """Ask the cluster, before faust starts, whether this principal may see the worker's group and topics.

    faust waits forever on a group it may not join (aiokafka keeps the refusal for a ``getmany`` faust does
    not call), and on a wrong password it starts like on a broker that is down. The group's coordinator answers
    only principals with Describe on the group (Read implies it); the topics' metadata only those with Describe.
    Read itself is checked when faust joins and fetches
    (:class:`agentstream.streams.dependency_adapters.WorkerConsumerThread`).
    """
    options = client_options(config.kafka, bootstrap_servers)
    admin = AIOKafkaAdminClient(**options)
    await admin.start()
    try:
        await find_coordinator(admin, config.streams.app_id)
    finally:
        await admin.close()
    names = ["spans", "streams.groups", "transitions", "dlq"]
    await check_topic_access(options, [topic_name(config.topics, name) for name in names], worker_operation(config))


async def prepare_kafka(config: Config, bootstrap_servers: str) -> None:
    """Everything the worker asks of Kafka before faust starts, a refusal named (KafkaAccessDenied,
    KafkaAuthenticationFailed) instead of a traceback or a wait without end."""
    async with named_refusals(client_options(config.kafka, bootstrap_servers), worker_operation(config)):
        await prepare_topics(config, bootstrap_servers)
        await check_access(config, bootstrap_servers)
        await evict_dead_workers(config, bootstrap_servers)


def named_crash(config: Config, bootstrap_servers: str, crash: BaseException | None) -> KafkaSetupError | None:
    """The named error behind a faust crash, if Kafka refused the worker once it ran: an ACL (Read on a topic or
    the group) or a session timeout below the broker's minimum. None for any other crash."""
    if isinstance(crash, InvalidSessionTimeoutError):
        return session_timeout_refused("[streams] session_timeout_s", config.streams.session_timeout_s)
    if isinstance(crash, AUTHORIZATION_ERRORS):
        return access_denied(client_options(config.kafka, bootstrap_servers), crash, worker_operation(config))
    return None


def member_ledger(config: Config) -> MemberLedger:
    """The ids this stack home's workers had in the group (faust's group id is the app id)."""
    return MemberLedger(config.stack.home, config.streams.app_id)


async def evict_dead_workers(config: Config, bootstrap_servers: str) -> None:
    """Remove the group members of workers that died here, so a restarted worker joins at once (infra/members.py)."""
    await evict_dead_members(client_options(config.kafka, bootstrap_servers), member_ledger(config))


def _records(events) -> list[RawRecord]:
    return [RawRecord(e.message.topic, e.message.partition, e.message.offset, e.message.key, e.message.value, e)
            for e in events]


def _credentials(config: Config):
    kafka = config.kafka
    if kafka.sasl_mechanism:
        return faust.SASLCredentials(username=kafka.sasl_username,
                                     password=kafka.sasl_password.reveal() if kafka.sasl_password else None,
                                     mechanism=kafka.sasl_mechanism,
                                     ssl_context=client_options(kafka, "").get("ssl_context"))
    if kafka.security_protocol == "SSL":
        return faust.SSLCredentials(client_options(kafka, "")["ssl_context"])
    return None


def create_app(config: Config, bootstrap_servers: str, clickhouse_url: str) -> faust.App:
    """The streams application: spans and groups agents, their timers, their processors."""
    settings = config.streams
    state_folder = config.stack.home / "streams"
    state_folder.mkdir(parents=True, exist_ok=True)  # faust creates its data folder, not the folders above it
    app = faust.App(
        settings.app_id, broker=[f"kafka://{server}" for server in bootstrap_servers.split(",")],
        broker_credentials=_credentials(config), key_serializer="raw", value_serializer="raw",
        broker_session_timeout=settings.session_timeout_s, broker_heartbeat_interval=0.5,
        consumer_auto_offset_reset="earliest", topic_partitions=config.topics.partitions,
        topic_replication_factor=config.topics.replication_factor, web_enabled=False, store="memory://",
        topic_disable_leader=True,  # nothing runs on_leader: no `<app_id>-__assignor-__leader` topic, nor its ACLs
        stream_wait_empty=False, broker_commit_every=1000, broker_commit_interval=0.5, producer_acks=-1,
        datadir=str(state_folder / "{conf.name}-data"),  # faust's default is the current directory
        TableManager=PromptTableManager,
    )
    app.transport = StreamsTransport(app.conf.broker_consumer, app, fetch_max_wait_ms=settings.fetch_max_wait_ms,
                                     read_gap_patience_s=config.kafka.read_gap_patience_s)
    ledger = member_ledger(config)
    options = client_options(config.kafka, bootstrap_servers)
    emitter = KafkaEmitter(config.kafka, options)
    holder = FaustHolder()

    def warehouse() -> Warehouse:
        return Warehouse(config.clickhouse, clickhouse_url, retry_max_s=settings.clickhouse_retry_max_s)

    sink = CompletionSink(warehouse(), config.clickhouse.database, holder, settings.store_interval_s)
    spans = SpanProcessor(config, warehouse(), warehouse(), emitter, holder, sink)
    groups = GroupProcessor(config, emitter, holder, sink)
    # for introspection in tests and status; faust.App declares no such attribute
    app.processors = {"spans": spans, "groups": groups}  # type: ignore[attr-defined]
    lock = asyncio.Lock()

    spans_topic = app.topic(topic_name(config.topics, "spans"), key_type=bytes, value_type=bytes)
    groups_topic = app.topic(topic_name(config.topics, "streams.groups"), key_type=bytes, value_type=bytes)

    @app.task
    async def restore() -> None:
        async with lock:
            await spans.restore()

    @app.task
    async def store_completions() -> None:
        await sink.run()

    def consume(topic: faust.TopicT, processor: Stage[Any]) -> None:
        """An agent that feeds ``topic`` to ``processor`` in batches; a crash stops the worker, which then replays."""
        ingestion = Ingestion(processor, holder, settings.ingest_interval_s)

        async def agent(stream: faust.StreamT[Any]) -> None:
            assert isinstance(stream, faust.Stream)  # faust hands agents a Stream; StreamT lacks take_events
            async for events in stream.take_events(settings.batch_max_records, within=settings.batch_within_s):
                records = _records(events)
                batch = processor.read(records)
                async with lock:
                    processor.apply(batch)
                published = min((e.message.timestamp for e in events if e.message.timestamp), default=None)
                await ingestion.put(records, batch, published)

        async def store() -> None:
            await ingestion.run()

        agent.__name__ = agent.__qualname__ = f"{topic.get_topic_name()}-agent"
        store.__name__ = store.__qualname__ = f"{topic.get_topic_name()}-store"
        app.agent(topic, supervisor_strategy=CrashingSupervisor)(agent)
        app.task(store)

    consume(spans_topic, spans)
    consume(groups_topic, groups)

    @app.timer(interval=0.02)
    async def tick() -> None:
        async with lock:
            await spans.tick()
            await groups.tick()

    @app.timer(interval=1.0)
    async def check_log_ends() -> None:
        consumer = app.consumer
        if isinstance(consumer, StreamsConsumer):
            await consumer.check_log_ends()

    @app.timer(interval=CYCLE_COLLECTION_S)
    async def collect_cycles() -> None:
        started = time.perf_counter()
        found = gc.collect()
        spent_ms = 1000 * (time.perf_counter() - started)
        log.info("cycle collector: %d unreachable objects freed in %.1f ms", found, spent_ms)

    @app.timer(interval=10.0)
    async def report() -> None:
        counters = spans.counters
        log.info("records %d, spans records %d, rollouts completed %d (awaiting reward %d, expired %d, read back "
                 "from ClickHouse %d), transitions %d, calls without token ids %d, dead letters %d, "
                 "groups %d credited / %d uninformative, prefix merges %d / breaks %d",
                 counters.records, counters.spans_records, counters.rollouts_completed,
                 counters.rollouts_awaiting_reward, counters.rollouts_expired, counters.rollouts_read_back,
                 counters.transitions + groups.counters.transitions,
                 counters.calls_without_tokens, counters.dead_letters, groups.groups_credited,
                 groups.groups_uninformative, counters.prefix_merges, counters.prefix_breaks)
        spent = {**spans.span_writes.seconds, **spans.reads.seconds, **sink.warehouse.seconds}
        timings = ", ".join(f"{what} {calls} x {1000 * seconds / max(calls, 1):.0f} ms"
                            for what, (calls, seconds) in spent.items())
        log.info("ClickHouse calls: %s", timings)

    @app.on_partitions_assigned.connect
    async def log_assignment(app: faust.App, assigned: AbstractSet[TP] = frozenset(), /, *args: Any,
                             **kwargs: Any) -> None:
        mine = sorted((tp.topic, tp.partition) for tp in assigned if tp.topic == spans_topic.get_topic_name())
        log.info("assigned %s partitions %s", spans_topic.get_topic_name(), [p for _, p in mine])
        underlying = kafka_consumer(app.consumer)
        joined = member_id(underlying) if underlying is not None else None
        if joined:
            ledger.record(joined)

    @app.on_partitions_revoked.connect
    async def mark_rejoining(app: faust.App, revoked: AbstractSet[TP] = frozenset(), /, *args: Any,
                             **kwargs: Any) -> None:
        ledger.mark_rejoining()

    @app.on_before_shutdown.connect
    async def stop_emitter(app: faust.App, /, *args: Any, **kwargs: Any) -> None:
        await emitter.stop()

    return app


class StreamsWorker(faust.Worker):
    """faust's worker with a hard shutdown deadline: SIGTERM or SIGINT ends it within ``shutdown_grace_s``.

    faust stops its services one by one, and with the broker gone its Kafka clients retry for
    minutes (it was still running 70 s after SIGTERM). Offsets are committed only for what is
    stored, so whatever the deadline abandons is read again by the next worker.
    """

    def __init__(self, app: faust.App, deadline: ShutdownDeadline, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.deadline = deadline

    def _on_sigterm(self) -> None:
        self.deadline.arm()
        super()._on_sigterm()

    def _on_sigint(self) -> None:
        self.deadline.arm()
        super()._on_sigint()


def streams_worker(app: faust.App, config: Config, loglevel: str) -> StreamsWorker:
    """The worker that runs ``app`` until signalled, and at most ``streams.shutdown_grace_s`` after."""
    processors = app.processors  # type: ignore[attr-defined]

    def abandoned() -> str:
        return f"{len(processors['spans'].tracker.open)} open rollouts (their first records were not committed)"

    deadline = ShutdownDeadline("streams worker", config.streams.shutdown_grace_s, abandoned)
    return StreamsWorker(app, deadline, loglevel=loglevel, quiet=True)

"""The runner: a pool of workers that consumes the `tasks` topic as a consumer group and runs the agent.

Each task becomes one rollout attempt: STARTED, periodic HEARTBEAT, then SUCCEEDED, FAILED or
TIMED_OUT on the spans topic, with the agent's spans in between. Failures and timeouts are
retried by re-enqueueing the task with the next attempt number, up to ``max_attempts``. A
task's offset is committed only after its rollout ended and its spans were handed to the
publisher, so a crashed runner's tasks are redelivered to another member of the group.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import inspect
import json
import logging
import os
import socket
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from agentstream.infra.config import AglConfig, Config
from agentstream.infra.gaps import GapGuard
from agentstream.infra.kafka import client_options, consumer_options, session_timeout_checked, topic_name
from agentstream.infra.logreset import ConsumerLogWatch
from agentstream.infra.members import MemberLedger, evict_dead_members, member_id
from agentstream.pipeline.proxy.access import proxy_client_key
from agentstream.pipeline.runner.agl import adapt_agent
from agentstream.pipeline.runner.errors import AgentLoadError
from agentstream.pipeline.runner.tasks import enqueue
from agentstream.pipeline.sdk import HEARTBEAT_S, Rollout, SpanSink, emit_exception, emit_reward, new_id, rollout
from agentstream.schemas import TASK, AvroCodec, CodecError
from agentstream.schemas.records import TaskRecord

log = logging.getLogger("agentstream.runner")

AgentFunction = Callable[..., Any]


def load_agent(spec: str, agl: AglConfig | None = None) -> AgentFunction:
    """Import ``module:function`` (the current directory is importable, as users expect).

    An Agent Lightning agent (``@rollout``, a ``LitAgent``, a 1.0 agent class) comes back adapted
    to the runner's calling convention, with ``agl``'s resources (``pipeline/runner/agl.py``).
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise AgentLoadError(f"expected module:function, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise AgentLoadError(f"cannot import {module_name!r}: {error}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise AgentLoadError(f"{module_name!r} has no callable {attribute!r}")
    return adapt_agent(function, spec, agl) or function


async def call_agent(agent: AgentFunction, payload: Any, state: Rollout,
                     threads: ThreadPoolExecutor | None = None) -> Any:
    """Call an agent on one task: with the rollout when it takes two parameters; a sync one in ``threads``."""
    args = (payload, state) if len(inspect.signature(agent).parameters) >= 2 else (payload,)
    if inspect.iscoroutinefunction(agent):
        return await agent(*args)
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(threads, context.run, agent, *args)


@dataclass
class RunnerOptions:
    """How a runner process consumes tasks and runs rollouts."""

    concurrency: int = 4
    group_id: str = "agentstream-runners"
    heartbeat_s: float = HEARTBEAT_S
    retry_on_exception: bool = True
    retry_on_timeout: bool = True
    proxy_url: str | None = None
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    session_timeout_ms: int = 4_000  # a fresh join takes about half of it on tansu (infra/members.py)


@dataclass
class RunnerStats:
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    retried: int = 0
    undecodable: int = 0

    @property
    def finished(self) -> int:
        return self.succeeded + self.failed + self.timed_out


class OffsetTracker:
    """Which offsets of one partition are done, so commits never skip a task still running."""

    def __init__(self) -> None:
        self.pending: set[int] = set()
        self.highest_done = -1

    def start(self, offset: int) -> None:
        self.pending.add(offset)

    def done(self, offset: int) -> None:
        self.pending.discard(offset)
        self.highest_done = max(self.highest_done, offset)

    def committable(self) -> int | None:
        """The offset to commit: the oldest still running, or one past the newest done."""
        if self.pending:
            return min(self.pending)
        return self.highest_done + 1 if self.highest_done >= 0 else None


class _CommitOnRevoke(ConsumerRebalanceListener):
    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked) -> None:
        if self.runner.ledger is not None:
            self.runner.ledger.mark_rejoining()
        await self.runner.commit()

    async def on_partitions_assigned(self, assigned) -> None:
        runner = self.runner
        for tp in assigned:
            runner.gaps.forget(tp)
            if runner.log_watch is not None:
                runner.log_watch.moved(tp, None)
        joined = member_id(runner._consumer) if runner._consumer is not None else None
        if joined and runner.ledger is not None:
            runner.ledger.record(joined)


class Runner:
    """Consumes tasks, runs ``agent`` on each, and publishes the rollout's spans and events to ``sink``.

    ``agent`` is the function, or its ``module:function`` spec (:func:`load_agent`, with ``agl``),
    imported in a thread while the runner joins its group: a restarted runner then waits for the
    join (about 2 s on tansu) and the import (0.8 s for the demo's agent, which imports openai)
    side by side, not one after the other. Its rollouts present ``config``'s proxy key
    (:func:`~pipeline.access.proxy_client_key`) to the proxy.
    """

    def __init__(self, agent: AgentFunction | str, config: Config, bootstrap_servers: str, sink: SpanSink,
                 options: RunnerOptions | None = None, agl: AglConfig | None = None) -> None:
        self.agent: AgentFunction | str = agent
        self.agl = agl
        self.config = config
        self.bootstrap_servers = bootstrap_servers
        self.sink = sink
        self.options = options or RunnerOptions()
        self.proxy_key = proxy_client_key(config)
        self.codec = AvroCodec()
        self.stats = RunnerStats()
        self._threads = ThreadPoolExecutor(max_workers=self.options.concurrency, thread_name_prefix="agent")
        self._offsets: dict[TopicPartition, OffsetTracker] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self.log_watch: ConsumerLogWatch | None = None
        self.ledger: MemberLedger | None = None
        self.gaps = GapGuard("runner", config.kafka.read_gap_patience_s)

    async def run(self, stop: asyncio.Event | None = None, max_tasks: int | None = None) -> RunnerStats:
        """Run until ``stop`` is set or ``max_tasks`` rollouts finished; in-flight rollouts finish first."""
        stop = stop or asyncio.Event()
        topic = topic_name(self.config.topics, "tasks")
        options = client_options(self.config.kafka, self.bootstrap_servers)
        self.ledger = MemberLedger(self.config.stack.home, self.options.group_id)
        await evict_dead_members(options, self.ledger)  # a crashed predecessor would hold its tasks for a session
        consumer = AIOKafkaConsumer(
            **consumer_options(self.config.kafka, self.bootstrap_servers), group_id=self.options.group_id,
            enable_auto_commit=False, auto_offset_reset="earliest",
            session_timeout_ms=self.options.session_timeout_ms, heartbeat_interval_ms=500,
            max_poll_interval_ms=24 * 3600 * 1000,
        )
        consumer.subscribe([topic], listener=_CommitOnRevoke(self))
        self._consumer = consumer
        watch = self.log_watch = ConsumerLogWatch("runner", consumer)
        with session_timeout_checked("`agentstream run --session-timeout-ms`", self.options.session_timeout_ms / 1000):
            await self._join_and_load(consumer)
        slots = asyncio.Semaphore(self.options.concurrency)
        running: set[asyncio.Task] = set()
        started = 0
        try:
            while not stop.is_set() and (max_tasks is None or started < max_tasks):
                await slots.acquire()
                batch = await consumer.getmany(timeout_ms=200, max_records=1)
                for reset in await watch.check(batch):  # the partition is read again from its start
                    self._offsets[TopicPartition(reset.topic, reset.partition)] = OffsetTracker()
                    self.gaps.forget(TopicPartition(reset.topic, reset.partition))
                records = [record for records in batch.values() for record in self._past_no_hole(consumer, records)]
                if not records:
                    slots.release()
                    await self.commit()
                    continue
                for record in records:
                    started += 1
                    tp = TopicPartition(record.topic, record.partition)
                    tracker = self._offsets.setdefault(tp, OffsetTracker())
                    tracker.start(record.offset)
                    task = asyncio.create_task(self._handle(record, tp, tracker, slots))
                    running.add(task)
                    task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running)
            await self.commit()
        finally:
            await consumer.stop()
            self._threads.shutdown(wait=False, cancel_futures=True)
        return self.stats

    def _past_no_hole(self, consumer: AIOKafkaConsumer, records: list) -> list:
        """``records`` of one partition up to a hole in their offsets; past one, the partition is read again from it."""
        for index, record in enumerate(records):
            tp = TopicPartition(record.topic, record.partition)
            again = self.gaps.admit(tp, record.offset, f"{record.topic}[{record.partition}]")
            if again is not None:  # infra/gaps.py
                consumer.seek(tp, again)
                self.gaps.expect(tp, again)
                return records[:index]
        return records

    async def _join_and_load(self, consumer: AIOKafkaConsumer) -> None:
        """Start ``consumer`` (it waits for the first join's answer) while the agent's spec is imported."""
        spec = self.agent
        if not isinstance(spec, str):
            await consumer.start()
            return
        joining = asyncio.ensure_future(consumer.start())
        try:
            self.agent = await asyncio.to_thread(load_agent, spec, self.agl)
        except BaseException:  # an agent that cannot load takes no tasks: leave the group at once
            joining.cancel()
            await asyncio.gather(joining, return_exceptions=True)
            await consumer.stop()
            raise
        await joining

    def unfinished(self) -> str:
        """What a forced exit abandons, for its log line (read from another thread: plain reads only)."""
        running = sum(len(tracker.pending) for tracker in list(self._offsets.values()))
        return f"{running} rollouts in flight (their tasks were not committed and go to another runner)"

    async def commit(self) -> None:
        if self._consumer is None:
            return
        offsets = {}
        assigned = self._consumer.assignment()
        for tp, tracker in self._offsets.items():
            position = tracker.committable()
            if position is not None and tp in assigned:
                offsets[tp] = position
        if offsets:
            try:
                await self._consumer.commit(offsets)
            except Exception as error:  # a rebalance in progress: the next commit catches up
                log.warning("offset commit failed (%s); will retry", error)

    async def _handle(self, record, tp: TopicPartition, tracker: OffsetTracker, slots: asyncio.Semaphore) -> None:
        """Run one task; ``tracker`` is the partition's at the time it was read (a log reset replaces it)."""
        try:
            try:
                task = cast(TaskRecord, self.codec.decode(record.value, TASK)[1])
            except CodecError as error:
                self.stats.undecodable += 1
                log.error("task at %s@%d is not a Task record (%s); skipped", tp, record.offset, error)
                return
            await self._run_attempt(task)
        finally:
            tracker.done(record.offset)
            slots.release()

    async def _run_attempt(self, task: TaskRecord) -> None:
        attempt = task["attempt"]
        scope = rollout(
            task.get("agent_name"), rollout_id=task["rollout_id"],
            attempt_id=f"{task['rollout_id']}-a{attempt}-{new_id()[:6]}", task_id=task["task_id"],
            group_id=task.get("group_id"), sink=self.sink, proxy_url=self.options.proxy_url,
            worker_id=self.options.worker_id, attempt=attempt, proxy_key=self.proxy_key,
            heartbeat_s=self.options.heartbeat_s,
            train=False if (task.get("metadata") or {}).get("mode") == "val" else None,  # evaluation, never trained on
        )
        state = scope.__enter__()  # on this loop: it beats until it finishes
        try:
            payload = json.loads(task["input"])
            result = await asyncio.wait_for(self._call(payload, state), timeout=task["timeout_s"])
            if isinstance(result, (int, float)) and not isinstance(result, bool):
                emit_reward(result)  # a NaN or infinite result fails the attempt with a RewardError
            scope.finish("SUCCEEDED")
            self.stats.succeeded += 1
        except TimeoutError:
            scope.finish("TIMED_OUT", f"no result within {task['timeout_s']}s")
            self.stats.timed_out += 1
            if self.options.retry_on_timeout:
                await self._retry(task)
        except Exception as error:
            emit_exception(error)
            scope.finish("FAILED", f"{type(error).__name__}: {error}")
            self.stats.failed += 1
            if self.options.retry_on_exception:
                await self._retry(task)
        except asyncio.CancelledError:  # the runner stops: its task is delivered again, this attempt ends silent
            scope.abandon()
            raise

    async def _call(self, payload: Any, state: Rollout) -> Any:
        assert not isinstance(self.agent, str)  # loaded before the first task is read
        return await call_agent(self.agent, payload, state, self._threads)

    async def _retry(self, task: TaskRecord) -> None:
        if task["attempt"] >= task["max_attempts"]:
            return
        await enqueue(self.config, self.bootstrap_servers, [{**task, "attempt": task["attempt"] + 1}], self.codec)
        self.stats.retried += 1

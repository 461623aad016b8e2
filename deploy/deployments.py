"""Deployments: which version of each trained model serves live traffic, and every decision that changed it.

A decision is a Deployment event (schemas/avro/deployment.avsc) on the compacted deployments
topic, keyed by model, and a row of the ClickHouse ``deployments`` table. Each event carries
the routing in force after it, so the latest event per model is all a reader needs: the proxy
and hot swap fold the topic into one :class:`Routing` per model with :class:`DeploymentFollower`.
The gate, hot swap (when no gate runs) and ``agentstream promote``/``rollback`` write decisions
with :class:`DeploymentLog`.

The same topic carries :class:`Announcement` records (schemas/avro/announcement.avsc): the gate
and hot swap say with :func:`announce` that they run for a model, and with which ``agentstream.deploy.gate``.
Only one of them may decide what serves, so a hot swap that promotes every checkpoint itself
(``deploy.gate = false``) and a gate for the same model refuse to run side by side: whichever
starts second reads the other's live announcement and stops with :class:`GateDisagreement`.
"""


from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from clickhouse_connect.driver.exceptions import OperationalError

from agentstream.infra.config import Config
from agentstream.infra.kafka import (
    check_topic_access,
    client_options,
    consumer_options,
    refusal,
    start_producer,
    topic_name,
)
from agentstream.schemas import ANNOUNCEMENT, DEPLOYMENT, AvroCodec, CodecError
from agentstream.schemas.errors import AgentstreamError

log = logging.getLogger("agentstream.deployments")

ROW_RETRY_MAX_S = 10.0
"""The longest wait between two tries of a decision's ClickHouse row while ClickHouse is away."""


class Action(StrEnum):
    """What a decision did to a version (the Deployment event's ``action``)."""

    CANDIDATE = "CANDIDATE"
    REJECTED = "REJECTED"
    CANARY = "CANARY"
    PROMOTED = "PROMOTED"
    ROLLED_BACK = "ROLLED_BACK"
    SUPERSEDED = "SUPERSEDED"
    OTHER = "OTHER"  # how a reader decodes an action added after it was written (the schema's enum default)


class DeploymentError(AgentstreamError, RuntimeError):
    """A decision cannot be made or recorded (unknown model or version, broker unreachable)."""


class GateDisagreement(DeploymentError):
    """A gate and a hot swap that promotes every checkpoint itself would both decide what serves one model."""


ADAPTER_SUFFIX = re.compile(r"^(?P<model>.+)@v(?P<version>\d+)$")


def adapter_name(model: str, version: int) -> str:
    """The LoRA name version ``version`` of ``model`` is served under (what a client names to pin it)."""
    return f"{model}@v{version}"


def split_adapter_name(name: str) -> tuple[str, int | None]:
    """``("M", 5)`` for ``"M@v5"``; ``(name, None)`` for a name without a version."""
    match = ADAPTER_SUFFIX.match(name)
    return (match["model"], int(match["version"])) if match else (name, None)


def share_of(key: str) -> float:
    """A stable point in [0, 1) for ``key``: the same rollout always falls on the same side of a share."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2.0 ** 64


@dataclass(frozen=True)
class Routing:
    """Which versions of one model serve which traffic, after the latest decision about it.

    Version 0 is the base model. ``stable_version`` serves every rollout not in the canary
    share; ``canary_version`` (if any) serves the rollouts whose :func:`share_of` falls below
    ``canary_share``; ``candidate_version`` is loaded for evaluation and serves only requests
    that pin it. With ``format == "full"`` the server holds one set of weights, so only the
    stable version is reachable.
    """

    model: str
    stable_version: int = 0
    stable_uri: str = ""
    format: str = "lora"
    canary_version: int | None = None
    canary_share: float = 0.0
    candidate_version: int | None = None

    def loaded_versions(self) -> list[int]:
        """The versions a request may pin: those the server is meant to hold."""
        if self.format == "full":
            return [self.stable_version]
        versions = {0, self.stable_version}
        versions.update(v for v in (self.canary_version, self.candidate_version) if v is not None)
        return sorted(versions)

    def choose(self, rollout_key: str) -> tuple[int, str]:
        """The version serving a rollout, and why ("canary" or "stable")."""
        if self.canary_version is not None and self.format != "full" and share_of(rollout_key) < self.canary_share:
            return self.canary_version, "canary"
        return self.stable_version, "stable"

    def describe(self) -> str:
        serving = f"v{self.stable_version}" if self.stable_version else "the base model (v0)"
        if self.canary_version is not None:
            serving += f", canary v{self.canary_version} on {self.canary_share:.0%} of rollouts"
        if self.candidate_version is not None:
            serving += f", candidate v{self.candidate_version} under evaluation"
        return serving


@dataclass(frozen=True)
class Decision:
    """One deployment decision and the routing it leaves in force."""

    version: int
    action: Action
    decided_by: str
    reason: str
    routing: Routing
    candidate_score: float | None = None
    stable_score: float | None = None
    eval_tasks: int = 0
    canary_reward: float | None = None
    canary_rollouts: int = 0
    stable_reward: float | None = None
    stable_rollouts: int = 0
    at_us: int = 0
    decision_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def model(self) -> str:
        return self.routing.model

    def record(self) -> dict[str, Any]:
        """The Deployment event."""
        routing = self.routing
        return {
            "decision_id": self.decision_id, "model": routing.model, "version": self.version,
            "action": str(self.action), "decided_by": self.decided_by, "reason": self.reason,
            "format": routing.format, "stable_version": routing.stable_version, "stable_uri": routing.stable_uri,
            "canary_version": routing.canary_version, "canary_share": routing.canary_share,
            "candidate_version": routing.candidate_version, "candidate_score": self.candidate_score,
            "stable_score": self.stable_score, "eval_tasks": self.eval_tasks, "canary_reward": self.canary_reward,
            "canary_rollouts": self.canary_rollouts, "stable_reward": self.stable_reward,
            "stable_rollouts": self.stable_rollouts, "at_us": self.at_us,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Decision:
        """A Deployment event decoded with the current schema (so every field is there)."""
        routing = Routing(model=record["model"], stable_version=record["stable_version"],
                          stable_uri=record["stable_uri"], format=record["format"],
                          canary_version=record["canary_version"], canary_share=record["canary_share"],
                          candidate_version=record["candidate_version"])
        return cls(version=record["version"], action=Action(record["action"]),
                   decided_by=record["decided_by"], reason=record["reason"], routing=routing,
                   candidate_score=record["candidate_score"], stable_score=record["stable_score"],
                   eval_tasks=record["eval_tasks"], canary_reward=record["canary_reward"],
                   canary_rollouts=record["canary_rollouts"], stable_reward=record["stable_reward"],
                   stable_rollouts=record["stable_rollouts"], at_us=record["at_us"],
                   decision_id=record["decision_id"])

    def row(self) -> list[Any]:
        """The ``deployments`` table row (columns in :data:`DEPLOYMENT_COLUMNS` order)."""
        record = self.record()
        at = datetime.datetime.fromtimestamp(self.at_us / 1e6, tz=datetime.UTC)
        return [record[name] for name in DEPLOYMENT_COLUMNS[:-1]] + [at]


DEPLOYMENT_COLUMNS = ("decision_id", "model", "version", "action", "decided_by", "reason", "format",
                      "stable_version", "canary_version", "canary_share", "candidate_version", "candidate_score",
                      "stable_score", "eval_tasks", "canary_reward", "canary_rollouts", "stable_reward",
                      "stable_rollouts", "decided_at")


def decide(previous: Routing, version: int, action: Action, decided_by: str, reason: str, **changes: Any) -> Decision:
    """A decision about ``version`` that changes the routing by ``changes`` (Routing fields) and sets the rest."""
    routing_fields = {name: changes.pop(name) for name in list(changes) if name in Routing.__dataclass_fields__}
    return Decision(version=version, action=action, decided_by=decided_by, reason=reason,
                    routing=replace(previous, **routing_fields), at_us=time.time_ns() // 1000, **changes)


class DeploymentLog:
    """Records decisions: the event on the deployments topic (acknowledged by the broker), then the ClickHouse row.

    ``warehouse`` is a clickhouse-connect client, or None where the caller has no ClickHouse
    (the row is then missing; the event is the source of truth). Records are taken one at a
    time: such a client runs one statement at a time (hot swap over a fleet records from one
    loop per server), and the events then reach the topic in the order the rows are written.
    """

    def __init__(self, config: Config, bootstrap_servers: str, warehouse: Any = None) -> None:
        self.topic = topic_name(config.topics, "deployments")
        self.table = f"{config.clickhouse.database}.deployments"
        self.codec = AvroCodec()
        self.warehouse = warehouse
        self._kafka, self._options = config.kafka, client_options(config.kafka, bootstrap_servers)
        self._producer: AIOKafkaProducer | None = None
        self._recording = asyncio.Lock()

    async def start(self) -> None:
        self._producer = await start_producer(self._kafka, self._options)

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()

    async def _store_row(self, decision: Decision) -> None:
        """The decision's ClickHouse row, retried while ClickHouse cannot be reached (the topic already holds it)."""
        delay, since = 0.5, None
        while True:
            try:
                await asyncio.to_thread(self.warehouse.insert, self.table, [decision.row()],
                                        column_names=list(DEPLOYMENT_COLUMNS))
            except OperationalError as error:  # no connection: ClickHouse is restarting or away
                if since is None:
                    since = time.monotonic()
                    log.warning("ClickHouse unreachable while recording %s v%d %s (%s): retrying",
                                decision.model, decision.version, decision.action, str(error).splitlines()[0][:200])
                await asyncio.sleep(delay)
                delay = min(delay * 2, ROW_RETRY_MAX_S)
                continue
            if since is not None:
                log.warning("ClickHouse is back: %s v%d recorded after %.1f s", decision.model, decision.version,
                            time.monotonic() - since)
            return

    async def record(self, decision: Decision) -> None:
        async with self._recording:
            assert self._producer is not None, "DeploymentLog.record before start"
            await self._producer.send_and_wait(self.topic, key=decision.model.encode(),
                                               value=self.codec.encode(DEPLOYMENT, decision.record()))
            if self.warehouse is not None:
                await self._store_row(decision)
        log.info("%s v%d %s by %s: %s -> serving %s", decision.model, decision.version, decision.action,
                 decision.decided_by, decision.reason, decision.routing.describe())


ANNOUNCE_EVERY_S = 5.0
"""How often a running gate or hot swap renews its announcement."""
ANNOUNCEMENT_LIVE_S = 20.0
"""How long an announcement holds without renewal: a process that died unannounced is forgotten after this."""


@dataclass(frozen=True)
class Announcement:
    """A gate or hot swap saying that it runs for ``model`` with ``deploy.gate = gated`` (the Announcement event)."""

    model: str
    role: str
    gated: bool
    instance: str
    at_us: int
    live_s: float

    def live(self, now_us: int) -> bool:
        return now_us < self.at_us + self.live_s * 1e6

    def promotes_itself(self) -> bool:
        """A hot swap without the gate: it promotes every checkpoint it loads."""
        return self.role == "hotswap" and not self.gated

    def record(self) -> dict[str, Any]:
        """The Announcement event (``schemas/avro/announcement.avsc``)."""
        return {"model": self.model, "role": self.role, "gated": self.gated, "instance": self.instance,
                "at_us": self.at_us, "live_s": self.live_s}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Announcement:
        """An Announcement event decoded with the current schema."""
        return cls(model=record["model"], role=record["role"], gated=record["gated"], instance=record["instance"],
                   at_us=record["at_us"], live_s=record["live_s"])


HISTORY_WINDOW = 64
"""Records per step when the deployments topic's history is read newest first."""


class DeploymentFollower:
    """Folds the deployments topic into the routing of every model, from its start and then as decisions arrive.

    ``ready`` is set once the topic has been read to its end; ``on_decision`` sees every decision
    as it is folded in. While the broker is unreachable the last known routing stays in force and
    reading retries.

    With ``newest_first`` (the proxy) the records after the topic's end at start are read first,
    then the history backwards, :data:`HISTORY_WINDOW` records at a time, while new records keep
    being read as they come. A decision carries its model's whole routing, so a model is current
    (:meth:`current`) once its newest decision is read, however long the topic has grown: tansu
    does not compact it, and under load each fetch returns a few records (a restarted proxy took
    4.7 s over 170 decisions late in a ``make chaos`` run). ``on_decision`` then sees each model's
    newest decision of the history and every one after it.
    """

    def __init__(self, config: Config, bootstrap_servers: str,
                 on_decision: Callable[[Decision], None] | None = None, retry_s: float = 1.0, *,
                 newest_first: bool = False, patience_s: float = 30.0) -> None:
        self.config = config
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic_name(config.topics, "deployments")
        self.on_decision = on_decision
        self.retry_s = retry_s
        self.newest_first = newest_first
        self.patience_s = patience_s
        self.routes: dict[str, Routing] = {}
        self.announcements: dict[str, Announcement] = {}  # the latest of each process (by instance)
        self.ready = asyncio.Event()
        self.tail_read = asyncio.Event()
        """Set once the records up to the high watermark, from where reading began, are read."""
        self.codec = AvroCodec()
        self._next: int | None = None  # newest_first: the next offset of the forward read, kept across retries
        self._history: tuple[int, int] | None = None  # newest_first: [first, end) of the history not read yet
        self._models_known: set[str] = set()  # newest_first, while the history is read: models whose newest is folded
        self._instances_known: set[str] = set()
        self._progress = asyncio.Event()
        self._patience_ends: float | None = None
        self._impatient = False

    def routing(self, model: str) -> Routing | None:
        return self.routes.get(model)

    async def current(self, model: str) -> None:
        """Until ``model``'s routing is the topic's newest (or the whole topic is read), but no longer than
        ``patience_s`` from the start of :meth:`run`: after that a request is routed with what is known."""
        if self._patience_ends is None:
            self._patience_ends = time.monotonic() + self.patience_s
        while not self.ready.is_set() and not (self.tail_read.is_set() and model in self._models_known):
            left = self._patience_ends - time.monotonic()
            if left <= 0:
                if not self._impatient:
                    self._impatient = True
                    log.warning("the deployments topic %s is not read yet after %.0f s; requests are routed with "
                                "what is known until it is", self.topic, self.patience_s)
                return
            progress = self._progress
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(progress.wait(), left)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow until ``stop``, retrying while the broker is away; a refusal (login, ACL) is raised, not retried."""
        if self._patience_ends is None:
            self._patience_ends = time.monotonic() + self.patience_s
        while not stop.is_set():
            try:
                await self._follow(stop)
            except KafkaError as error:
                options = consumer_options(self.config.kafka, self.bootstrap_servers)
                if refused := await refusal(options, error, f"reading {self.topic}"):
                    raise refused from error
                log.warning("deployments topic %s unreadable (%s); keeping the last routing and retrying",
                            self.topic, error)
                await asyncio.sleep(self.retry_s)

    async def until_ready(self, following: asyncio.Task[None]) -> None:
        """Wait until the topic has been read to its end; raises what ended ``following`` (this ``run``) first."""
        ready = asyncio.ensure_future(self.ready.wait())
        try:
            await asyncio.wait({ready, following}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if not self.ready.is_set():
            await following

    async def _follow(self, stop: asyncio.Event) -> None:
        options = consumer_options(self.config.kafka, self.bootstrap_servers)
        await check_topic_access(options, [self.topic], f"reading {self.topic}")  # assign() alone would stall
        consumer = AIOKafkaConsumer(**options, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        try:
            partition = TopicPartition(self.topic, 0)
            consumer.assign([partition])
            if self.newest_first and self._next is None:
                first = (await consumer.beginning_offsets([partition]))[partition]
                self._next = (await consumer.end_offsets([partition]))[partition]  # tansu's may trail: read on
                self._history = (first, self._next) if self._next > first else None
            if self._next is None:
                await consumer.seek_to_beginning(partition)
            else:
                consumer.seek(partition, self._next)
            while not stop.is_set():
                fetched = await consumer.getmany(partition, timeout_ms=200)
                for record in fetched.get(partition, ()):
                    self._fold(record)
                position = await consumer.position(partition)
                if self._next is not None:
                    self._next = position
                high = consumer.highwater(partition)
                if high is None or position < high:
                    continue
                self.tail_read.set()
                if self._history is not None:
                    await self._read_older(consumer, partition)
                    consumer.seek(partition, position)
                elif not self.ready.is_set():
                    self.ready.set()
                    self._models_known.clear()
                    self._instances_known.clear()
                self._advance()
        finally:
            await consumer.stop()

    async def _read_older(self, consumer: AIOKafkaConsumer, partition: TopicPartition) -> None:
        """Fold the newest :data:`HISTORY_WINDOW` records of the history not read yet, newest first."""
        assert self._history is not None
        first, end = self._history
        start = max(first, end - HISTORY_WINDOW)
        consumer.seek(partition, start)
        window: list[Any] = []
        while await consumer.position(partition) < end:
            fetched = await consumer.getmany(partition, timeout_ms=200)
            window.extend(record for record in fetched.get(partition, ()) if record.offset < end)
        for record in reversed(window):
            self._fold(record, older=True)
        self._history = (first, start) if start > first else None

    def _advance(self) -> None:
        """Wake the requests waiting in :meth:`current`."""
        self._progress.set()
        self._progress = asyncio.Event()

    def _fold(self, record: Any, older: bool = False) -> None:
        """Take ``record`` as the newest word on its model or process; an ``older`` one only if nothing newer was."""
        if record.value is None:
            return
        try:
            if self.codec.writer_schema(record.value)[1] == ANNOUNCEMENT:
                said = Announcement.from_record(self.codec.decode(record.value, ANNOUNCEMENT)[1])
                if not (older and said.instance in self._instances_known):
                    self.announcements[said.instance] = said
                    if not self.ready.is_set():
                        self._instances_known.add(said.instance)
                return
            decision = Decision.from_record(self.codec.decode(record.value, DEPLOYMENT)[1])
        except (CodecError, KeyError, ValueError, TypeError) as error:
            log.error("skipped an unreadable deployment event at offset %d: %s", record.offset, error)
            return
        if older and decision.model in self._models_known:
            return
        if not self.ready.is_set():
            self._models_known.add(decision.model)
        self.routes[decision.model] = decision.routing
        if self.on_decision is not None:
            self.on_decision(decision)


async def read_routes(config: Config, bootstrap_servers: str, timeout_s: float = 30.0) -> dict[str, Routing]:
    """The routing of every model as the deployments topic says now (read to its end)."""
    follower = DeploymentFollower(config, bootstrap_servers)
    stop = asyncio.Event()
    task = asyncio.create_task(follower.run(stop))
    try:
        await asyncio.wait_for(follower.ready.wait(), timeout_s)
    except TimeoutError:
        raise DeploymentError(f"could not read the deployments topic {follower.topic} within {timeout_s:.0f} s "
                              f"from Kafka at {bootstrap_servers}") from None
    finally:
        stop.set()
        await task
    return follower.routes


def disagreement(mine: Announcement, others: list[Announcement], now_us: int) -> str | None:
    """Why ``mine`` may not run beside the live announcements of ``others`` for its model (None: it may)."""
    for other in others:
        if other.model != mine.model or other.instance == mine.instance or not other.live(now_us):
            continue
        if {mine.role, other.role} == {"gate", "hotswap"} and (mine.promotes_itself() or other.promotes_itself()):
            ago = max(0.0, (now_us - other.at_us) / 1e6)
            if mine.role == "hotswap":
                return (f"hot swap for {mine.model} runs with deploy.gate = false (it would promote every checkpoint "
                        f"itself) but the gate {other.instance} announced itself {ago:.0f} s ago: set deploy.gate = "
                        "true for hot swap, or stop the gate")
            return (f"the gate for {mine.model} would decide what serves, but hot swap {other.instance} (announced "
                    f"{ago:.0f} s ago) runs with deploy.gate = false and promotes every checkpoint itself: restart "
                    "hot swap with deploy.gate = true")
    return None


async def announce(config: Config, bootstrap_servers: str, model: str, role: str, *, gated: bool,
                   stop: asyncio.Event, timeout_s: float = 30.0) -> asyncio.Task:
    """Announce this process on the deployments topic, refuse to run beside a disagreeing one, renew until ``stop``.

    The announcement is written first and the topic then read past it, so of two disagreeing
    processes starting together at least the second in the log sees the first and refuses
    (:class:`GateDisagreement`, one line). The returned task renews it every
    :data:`ANNOUNCE_EVERY_S` and withdraws it once ``stop`` is set.
    """
    topic = topic_name(config.topics, "deployments")
    codec = AvroCodec()
    mine = Announcement(model, role, gated, f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}",
                        time.time_ns() // 1000, ANNOUNCEMENT_LIVE_S)
    producer = await start_producer(config.kafka, client_options(config.kafka, bootstrap_servers))
    try:
        await _say(producer, topic, codec, mine)
        others = await _announcements_up_to(config, bootstrap_servers, mine, timeout_s)
        refusal = disagreement(mine, others, time.time_ns() // 1000)
        if refusal is not None:
            await _say(producer, topic, codec, replace(mine, at_us=time.time_ns() // 1000, live_s=0.0))
            raise GateDisagreement(refusal)
    except BaseException:
        await producer.stop()
        raise
    task = asyncio.create_task(_keep_announcing(producer, topic, codec, mine, stop))
    _ANNOUNCING.add(task)
    task.add_done_callback(_ANNOUNCING.discard)
    return task


_ANNOUNCING: set[asyncio.Task] = set()  # keeps each renewal task alive while its caller ignores it


async def _say(producer: AIOKafkaProducer, topic: str, codec: AvroCodec, said: Announcement) -> None:
    # Partition 0: the one every DeploymentFollower reads.
    await producer.send_and_wait(topic, key=f"announce/{said.role}/{said.model}/{said.instance}".encode(),
                                 value=codec.encode(ANNOUNCEMENT, said.record()), partition=0)


async def _announcements_up_to(config: Config, bootstrap_servers: str, mine: Announcement,
                               timeout_s: float) -> list[Announcement]:
    """Every announcement on the topic, read until ``mine`` comes back (so nothing written before it is missed)."""
    follower = DeploymentFollower(config, bootstrap_servers)
    done = asyncio.Event()
    reading = asyncio.create_task(follower.run(done))
    try:
        deadline = time.monotonic() + timeout_s
        while mine.instance not in follower.announcements:
            if time.monotonic() > deadline or reading.done():
                raise DeploymentError(f"could not read this process's announcement back from {follower.topic} within "
                                      f"{timeout_s:.0f} s (Kafka at {bootstrap_servers})")
            await asyncio.sleep(0.05)
    finally:
        done.set()
        await reading
    return list(follower.announcements.values())


async def _keep_announcing(producer: AIOKafkaProducer, topic: str, codec: AvroCodec, mine: Announcement,
                           stop: asyncio.Event) -> None:
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), ANNOUNCE_EVERY_S)
            except TimeoutError:
                try:
                    await _say(producer, topic, codec, replace(mine, at_us=time.time_ns() // 1000))
                except KafkaError as error:  # the broker is away: renew at the next turn
                    log.warning("could not renew the %s announcement for %s: %s", mine.role, mine.model, error)
        await _say(producer, topic, codec, replace(mine, at_us=time.time_ns() // 1000, live_s=0.0))
    except KafkaError as error:
        log.warning("could not withdraw the %s announcement for %s: %s (it lapses in %.0f s)", mine.role, mine.model,
                    error, mine.live_s)
    finally:
        await producer.stop()

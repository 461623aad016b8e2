"""Deployments: which version of each trained model serves live traffic, and every decision that changed it.

A decision is a Deployment event (schemas/avro/deployment.avsc) on the compacted deployments
topic, keyed by model, and a row of the ClickHouse ``deployments`` table. Each event carries
the routing in force after it, so the latest event per model is all a reader needs: the proxy
and hot swap fold the topic into one :class:`Routing` per model with :class:`DeploymentFollower`.
The gate, hot swap (when no gate runs) and ``agentstream promote``/``rollback`` write decisions
with :class:`DeploymentLog`.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from infra.config import Config
from infra.kafka import client_options, consumer_options, topic_name
from schemas import CHECKPOINT, DEPLOYMENT, AvroCodec, CodecError

log = logging.getLogger("agentstream.deployments")


class Action(StrEnum):
    """What a decision did to a version (the Deployment event's ``action``)."""

    CANDIDATE = "CANDIDATE"
    REJECTED = "REJECTED"
    CANARY = "CANARY"
    PROMOTED = "PROMOTED"
    ROLLED_BACK = "ROLLED_BACK"
    SUPERSEDED = "SUPERSEDED"


class DeploymentError(RuntimeError):
    """A decision cannot be made or recorded (unknown model or version, broker unreachable)."""


ADAPTER_SUFFIX = re.compile(r"^(?P<model>.+)@v(?P<version>\d+)$")


def adapter_name(model: str, version: int) -> str:
    """The LoRA name version ``version`` of ``model`` is served under (what a client names to pin it)."""
    return f"{model}@v{version}"


def split_adapter_name(name: str) -> tuple[str, int | None]:
    """``("M", 5)`` for ``"M@v5"``; ``(name, None)`` for a name without a version."""
    match = ADAPTER_SUFFIX.match(name)
    return (match["model"], int(match["version"])) if match else (name, None)


def checkpoint_of(record: Any, model: str, codec: AvroCodec) -> dict | None:
    """The Checkpoint event a checkpoints-topic record holds for ``model`` (None: another model's, or unreadable)."""
    if record.key != model.encode() or record.value is None:
        return None
    try:
        return codec.decode(record.value, CHECKPOINT)[1]
    except CodecError as error:
        log.error("skipped an unreadable checkpoint event at offset %d: %s", record.offset, error)
        return None


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
    def from_record(cls, record: dict[str, Any]) -> Decision:
        routing = Routing(model=record["model"], stable_version=record["stable_version"],
                          stable_uri=record["stable_uri"], format=record["format"],
                          canary_version=record["canary_version"], canary_share=record["canary_share"],
                          candidate_version=record["candidate_version"])
        action = record["action"]
        return cls(version=record["version"], action=Action(action) if action in Action.__members__ else action,
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
    (the row is then missing; the event is the source of truth).
    """

    def __init__(self, config: Config, bootstrap_servers: str, warehouse: Any = None) -> None:
        self.topic = topic_name(config.topics, "deployments")
        self.table = f"{config.clickhouse.database}.deployments"
        self.codec = AvroCodec()
        self.warehouse = warehouse
        self._producer = AIOKafkaProducer(**client_options(config.kafka, bootstrap_servers), acks="all")

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def record(self, decision: Decision) -> None:
        await self._producer.send_and_wait(self.topic, key=decision.model.encode(),
                                           value=self.codec.encode(DEPLOYMENT, decision.record()))
        if self.warehouse is not None:
            await asyncio.to_thread(self.warehouse.insert, self.table, [decision.row()],
                                    column_names=list(DEPLOYMENT_COLUMNS))
        log.info("%s v%d %s by %s: %s -> serving %s", decision.model, decision.version, decision.action,
                 decision.decided_by, decision.reason, decision.routing.describe())


class DeploymentFollower:
    """Folds the deployments topic into the routing of every model, from its start and then as decisions arrive.

    ``ready`` is set once the topic has been read to its end (so a fresh proxy routes like the
    running ones before it serves); ``on_decision`` sees every decision as it is folded in.
    While the broker is unreachable the last known routing stays in force and reading retries.
    """

    def __init__(self, config: Config, bootstrap_servers: str,
                 on_decision: Callable[[Decision], None] | None = None, retry_s: float = 1.0) -> None:
        self.config = config
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic_name(config.topics, "deployments")
        self.on_decision = on_decision
        self.retry_s = retry_s
        self.routes: dict[str, Routing] = {}
        self.ready = asyncio.Event()
        self.codec = AvroCodec()

    def routing(self, model: str) -> Routing | None:
        return self.routes.get(model)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self._follow(stop)
            except KafkaError as error:
                log.warning("deployments topic %s unreadable (%s); keeping the last routing and retrying",
                            self.topic, error)
                await asyncio.sleep(self.retry_s)

    async def _follow(self, stop: asyncio.Event) -> None:
        consumer = AIOKafkaConsumer(**consumer_options(self.config.kafka, self.bootstrap_servers), group_id=None,
                                    enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        try:
            partition = TopicPartition(self.topic, 0)
            consumer.assign([partition])
            await consumer.seek_to_beginning(partition)
            while not stop.is_set():
                fetched = await consumer.getmany(timeout_ms=200)
                for records in fetched.values():
                    for record in records:
                        self._fold(record)
                high = consumer.highwater(partition)
                if not self.ready.is_set() and high is not None and await consumer.position(partition) >= high:
                    self.ready.set()
        finally:
            await consumer.stop()

    def _fold(self, record: Any) -> None:
        if record.value is None:
            return
        try:
            decision = Decision.from_record(self.codec.decode(record.value, DEPLOYMENT)[1])
        except (CodecError, KeyError, ValueError) as error:
            log.error("skipped an unreadable deployment event at offset %d: %s", record.offset, error)
            return
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

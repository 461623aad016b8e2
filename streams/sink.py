"""Writing completed work to ClickHouse off the hot path: rollouts rows and transitions, coalesced.

A tick publishes its transitions to Kafka at once (trainers wait for them) and hands the
ClickHouse writes here. One writer task gathers the completions of ``interval_s`` (ticks come
every 20 ms; an insert per tick would make ClickHouse create and merge parts all day), stores
them with one insert per table, then releases the records those completions held, so an
offset is committed only after what it produced is stored. The queue is bounded: while
ClickHouse is down, ticks wait here, the spans agent waits for them, and offsets stay put.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from agentstream.schemas.transition_writer import transitions_container
from agentstream.streams.clickhouse_io import Warehouse
from agentstream.streams.records import RawRecord


class RolloutRow(NamedTuple):
    """One row of the ``rollouts`` table: its fields are the table's columns, in their order (a tuple, for speed)."""

    rollout_id: str
    attempt_id: str
    task_id: str
    group_id: str
    agent_name: str
    model: str
    status: str
    start_time: datetime.datetime
    end_time: datetime.datetime
    span_count: int
    llm_calls: int
    llm_calls_without_tokens: int
    final_reward: float | None
    total_reward: float
    reward_dimensions: dict[str, float]
    policy_versions: list[int]
    updated_at: datetime.datetime
    training: str = ""  # opted_out, opted_in, sampled, sampled_out, not_trained; '' failed or awaiting a reward
    prefix_merges: int = 0  # trajectory level: calls merged into the sample before them
    prefix_breaks: int = 0  # trajectory level: samples split where a call's prompt broke the token prefix


ROLLOUT_COLUMNS: tuple[str, ...] = RolloutRow._fields


async def gather(queue: asyncio.Queue, interval_s: float, waited: Callable[[Any], float] = lambda item: 0.0) -> list:
    """Wait for an item, then until it has waited ``interval_s`` (``waited``: how long an item had waited when
    queued); return everything queued by then, in order."""
    items = [await queue.get()]
    await asyncio.sleep(max(0.0, interval_s - waited(items[0])))
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


class Releaser(Protocol):
    """What releases a held record (the framework's acknowledgement)."""

    def release(self, record: RawRecord) -> None: ...


@dataclass
class Completion:
    """One tick's ClickHouse writes and the records to release once they are stored."""

    rollouts: list[RolloutRow] = field(default_factory=list)
    transitions: list[bytes] = field(default_factory=list)
    release: list[RawRecord] = field(default_factory=list)


class CompletionSink:
    """A bounded queue of completions and the task that stores them (run it with :meth:`run`)."""

    def __init__(self, warehouse: Warehouse, database: str, holder: Releaser, interval_s: float = 0.5,
                 max_queued: int = 256) -> None:
        self.warehouse = warehouse
        self.database = database
        self.holder = holder
        self.interval_s = interval_s
        self.queue: asyncio.Queue[Completion] = asyncio.Queue(max_queued)

    async def put(self, completion: Completion) -> None:
        """Queue a completion; waits while the queue is full (ClickHouse slow or down)."""
        if completion.rollouts or completion.transitions or completion.release:
            await self.queue.put(completion)

    async def run(self) -> None:
        """Store queued completions for as long as the worker runs; a failure other than an outage stops it."""
        while True:
            await self.store(await gather(self.queue, self.interval_s))

    async def store(self, batch: list[Completion]) -> None:
        transitions = [datum for completion in batch for datum in completion.transitions]
        rollouts = [row for completion in batch for row in completion.rollouts]
        if transitions:
            await self.warehouse.insert_container(f"{self.database}.transitions_ingest",
                                                  transitions_container(transitions))
        await self.warehouse.insert_rows(f"{self.database}.rollouts", ROLLOUT_COLUMNS, rollouts)
        for completion in batch:
            for record in completion.release:
                self.holder.release(record)

"""The span processor: the spans topic in; ClickHouse rows, transitions and group results out.

Kafka Streams shape: ``process(records)`` consumes a batch of the spans topic and ``tick(now)``
fires on a timer; both write to the outputs and update explicit state (:class:`RolloutTracker`
plus the rollouts waiting for a late reward). Nothing is acknowledged before what it produced
is in ClickHouse and on Kafka, so a crash replays and deterministic ids make the replay harmless.

    spans ─► spans_ingest (ClickHouse decodes the Avro: spans, rollout_spans)
          ─► rollout lifecycle ─► trajectory ─► credit ─┬► transitions topic + table
                                                        ├► rollouts table
                                                        └► groups topic (grpo, keyed by group)
    undecodable records ─► dlq topic
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from infra.config import Config
from infra.kafka import topic_name
from schemas import DEAD_LETTER, ROLLOUT_RESULT, TRANSITION_BATCH, AvroCodec
from streams.credit import Credit, matching_rule, strategy_for
from streams.lifecycle import OpenRollout, RolloutTracker
from streams.ocf import container_blocks, container_file, varint
from streams.records import RawRecord, sort_records
from streams.trajectory import SpanNode, Trajectory, assemble, span_node
from streams.transitions import transition_id
from streams.warehouse import RejectedData, Warehouse

log = logging.getLogger("agentstream.streams")

ROLLOUT_COLUMNS = (
    "rollout_id", "attempt_id", "task_id", "group_id", "agent_name", "model", "status", "start_time", "end_time",
    "span_count", "llm_calls", "llm_calls_without_tokens", "final_reward", "total_reward", "reward_dimensions",
    "policy_versions", "updated_at",
)
SPAN_FIELDS = ("rollout_id, attempt_id, span_id, parent_id, name, kind, start_us, end_us, status, agent_name, "
               "task_id, group_id, model, policy_version, has_token_ids, reward, reward_dimensions")
FAILED_STATUSES = {"FAILED", "TIMED_OUT", "CANCELLED"}


class Emitter(Protocol):
    """Where output records go (a Kafka producer): send buffers, flush waits for the acknowledgements."""

    async def send(self, topic: str, key: bytes | None, value: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> None: ...

    async def flush(self) -> None: ...


class Holder(Protocol):
    """Keeps a record's offset from being committed until released (the framework's ack)."""

    def hold(self, record: RawRecord) -> None: ...

    def release(self, record: RawRecord) -> None: ...


@dataclass
class Counters:
    """What the processor has done, for status lines, tests and benchmarks."""

    records: int = 0
    spans_records: int = 0
    events: int = 0
    dead_letters: int = 0
    rollouts_completed: int = 0
    rollouts_awaiting_reward: int = 0
    rollouts_expired: int = 0
    rollouts_not_selected: int = 0
    transitions: int = 0
    calls_without_tokens: int = 0
    group_results: int = 0


@dataclass
class Awaiting:
    """A complete rollout with no reward yet: it waits (persisted as AWAITING_REWARD) until ``expires_at_s``."""

    row: tuple  # its rollouts row, rewritten with status EXPIRED when the wait ends
    expires_at_s: float

    @property
    def attempt_id(self) -> str:
        return self.row[1]


def utc(us: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(us / 1e6, tz=datetime.timezone.utc)


def now_us() -> int:
    return time.time_ns() // 1000


class Stage:
    """What every processor stage shares: configuration, its outputs, its offset holder and counters."""

    def __init__(self, config: Config, warehouse: Warehouse, emitter: Emitter, holder: Holder,
                 codec: AvroCodec | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.warehouse = warehouse
        self.emitter = emitter
        self.holder = holder
        self.codec = codec or AvroCodec()
        self.clock = clock
        self.database = config.clickhouse.database
        self.transitions_topic = topic_name(config.topics, "transitions")
        self.counters = Counters()


class SpanProcessor(Stage):
    """spans topic → ClickHouse (spans, rollouts, transitions) + transitions/groups/dlq topics."""

    def __init__(self, config: Config, warehouse: Warehouse, emitter: Emitter, holder: Holder,
                 codec: AvroCodec | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, warehouse, emitter, holder, codec, clock)
        self.tracker = RolloutTracker(config.streams.grace_s, config.streams.idle_timeout_s)
        self.awaiting: dict[str, Awaiting] = {}
        self.closed: set[str] = set()  # expired rollouts: a reward after expiry does not revive them
        self.recheck: set[str] = set()
        self.groups_topic = topic_name(config.topics, "streams.groups")
        self.dlq_topic = topic_name(config.topics, "dlq")

    async def restore(self) -> None:
        """Load the rollouts that wait for a late reward (or expired) from ClickHouse: state a replay cannot rebuild."""
        result = await self.warehouse.query(
            f"SELECT {', '.join(ROLLOUT_COLUMNS)} FROM {self.database}.rollouts "
            "FINAL WHERE status IN ('AWAITING_REWARD', 'EXPIRED') "
            "AND updated_at > now64(6) - toIntervalSecond({horizon:UInt64})",
            {"horizon": int(self.config.streams.reward_expiry_s * 2)})
        wall, mono = time.time(), self.clock()
        status_at, updated_at = ROLLOUT_COLUMNS.index("status"), ROLLOUT_COLUMNS.index("updated_at")
        for row in result.result_rows:
            if row[status_at] == "EXPIRED":
                self.closed.add(row[0])
            else:
                waited = wall - row[updated_at].timestamp()
                self.awaiting[row[0]] = Awaiting(tuple(row), mono + self.config.streams.reward_expiry_s - waited)

    async def process(self, records: list[RawRecord]) -> None:
        """Ingest a batch: spans into ClickHouse, events into the lifecycle, bad records to the dead letter topic."""
        now = self.clock()
        sorted_records = sort_records(records, self.codec)
        self.counters.records += len(records)
        good_spans = await self._ingest_spans(sorted_records.span_bodies, sorted_records.schemas, sorted_records.dead)
        for record, error in sorted_records.dead:
            await self._dead_letter(record, error)
        for record in good_spans:
            rollout_id = record.key.decode("utf-8", "replace")
            self.counters.spans_records += 1
            if rollout_id in self.awaiting:
                self.recheck.add(rollout_id)
            elif rollout_id not in self.closed and self.tracker.on_spans(rollout_id, record, now):
                self.holder.hold(record)
        for record, event in sorted_records.events:
            self.counters.events += 1
            if event["rollout_id"] in self.closed:
                continue
            self.awaiting.pop(event["rollout_id"], None)  # a new attempt supersedes the wait
            if self.tracker.on_event(event, record, now):
                self.holder.hold(record)
        if sorted_records.dead:
            await self.emitter.flush()

    async def _ingest_spans(self, bodies: dict[int, list[tuple[RawRecord, bytes]]], schemas: dict[int, dict],
                            dead: list[tuple[RawRecord, Exception]]) -> list[RawRecord]:
        accepted: list[RawRecord] = []
        for schema_id, items in bodies.items():
            try:
                await self.warehouse.insert_container(f"{self.database}.spans_ingest",
                                                      container_file(schemas[schema_id], [b for _, b in items]))
                accepted.extend(record for record, _ in items)
            except RejectedData:
                accepted.extend(await self._ingest_one_by_one(items, schemas[schema_id], dead))
        return accepted

    async def _ingest_one_by_one(self, items: list[tuple[RawRecord, bytes]], schema: dict,
                                 dead: list[tuple[RawRecord, Exception]]) -> list[RawRecord]:
        """The slow path after ClickHouse refused a batch: find the records it refuses, dead-letter only those."""
        accepted = []
        for record, body in items:
            try:
                await self.warehouse.insert_container(f"{self.database}.spans_ingest", container_file(schema, [body]))
                accepted.append(record)
            except RejectedData as error:
                dead.append((record, error))
        return accepted

    async def _dead_letter(self, record: RawRecord, error: Exception) -> None:
        self.counters.dead_letters += 1
        log.warning("dead letter from %s[%d]@%d: %s", record.topic, record.partition, record.offset, error)
        await self.emitter.send(self.dlq_topic, record.key, self.codec.encode(DEAD_LETTER, {
            "source_topic": record.topic, "partition": record.partition, "offset": record.offset, "key": record.key,
            "value": bytes(record.value), "error": str(error), "error_type": type(error).__name__, "at_us": now_us(),
        }))

    async def tick(self) -> None:
        """Complete the rollouts that are due, re-check the ones a late reward arrived for, expire the stale."""
        now = self.clock()
        due = self.tracker.pop_due(now)
        rechecked = [self.recheck.pop() for _ in range(len(self.recheck))]
        expired = [rid for rid, waiting in self.awaiting.items() if waiting.expires_at_s <= now and rid not in rechecked]
        if not (due or rechecked or expired):
            return
        spans = await read_spans(self.warehouse, self.database, [r.rollout_id for r in due] + rechecked)
        rows: list[tuple] = []
        finished: list[tuple[Trajectory, list[Credit], Any]] = []
        for rollout in due:
            status = self._status_of(rollout)
            trajectory = assemble(rollout.rollout_id, spans.get(rollout.rollout_id, []), status, rollout.attempt_id,
                                  rollout.error)
            rows.append(self._decide(trajectory, finished, now))
        for rollout_id in rechecked:
            waiting = self.awaiting.pop(rollout_id)
            trajectory = assemble(rollout_id, spans.get(rollout_id, []), "SUCCEEDED", waiting.attempt_id)
            rows.append(self._decide(trajectory, finished, now))
        for rollout_id in expired:
            waiting = self.awaiting.pop(rollout_id)
            self.closed.add(rollout_id)
            self.counters.rollouts_expired += 1
            rows.append(self._expired_row(waiting.row))
        await self._emit_transitions(finished)
        await self.warehouse.insert_rows(f"{self.database}.rollouts", ROLLOUT_COLUMNS, rows)
        for rollout in due:
            self.holder.release(rollout.held)

    def _status_of(self, rollout: OpenRollout) -> str:
        if rollout.terminal:
            return rollout.terminal
        return "TIMED_OUT" if rollout.managed else "COMPLETED"

    def _decide(self, trajectory: Trajectory, finished: list, now: float) -> tuple:
        """Route one assembled rollout: not trainable, waiting for a reward, grouped, or credited now."""
        status = trajectory.status
        self.counters.calls_without_tokens += len(trajectory.llm_calls) - len(trajectory.trainable_calls)
        if status in FAILED_STATUSES or not trajectory.spans:
            self.counters.rollouts_completed += 1
            return self._rollout_row(trajectory, status)
        if not trajectory.rewards:
            self.counters.rollouts_awaiting_reward += 1
            row = self._rollout_row(trajectory, "AWAITING_REWARD")
            self.awaiting[trajectory.rollout_id] = Awaiting(row, now + self.config.streams.reward_expiry_s)
            return row
        self.counters.rollouts_completed += 1
        model = trajectory.models[0] if trajectory.models else ""
        rule = matching_rule(self.config.credit, trajectory.agent_name, model)
        if rule is None or not rule.train:
            self.counters.rollouts_not_selected += 1
        elif strategy_for(rule).grouped and trajectory.group_id:
            finished.append((trajectory, [], rule))
        else:
            finished.append((trajectory, strategy_for(rule).assign(trajectory), rule))
        return self._rollout_row(trajectory, status)

    async def _emit_transitions(self, finished: list[tuple[Trajectory, list[Credit], Any]]) -> None:
        grouped = [(t, rule) for t, credits, rule in finished if not credits and strategy_for(rule).grouped]
        for trajectory, _ in grouped:
            self.counters.group_results += 1
            await self.emitter.send(self.groups_topic, trajectory.group_id.encode(), self.codec.encode(ROLLOUT_RESULT, {
                "rollout_id": trajectory.rollout_id, "attempt_id": trajectory.attempt_id,
                "group_id": trajectory.group_id, "agent_name": trajectory.agent_name, "status": trajectory.status,
                "final_reward": trajectory.final_reward, "completed_at_us": now_us()}))
        credited = [(t, c, rule) for t, c, rule in finished if c]
        await publish_transitions(self, credited)
        await self.emitter.flush()

    def _rollout_row(self, trajectory: Trajectory, status: str) -> tuple:
        calls = trajectory.llm_calls
        versions = sorted({c.policy_version for c in calls if c.policy_version is not None})
        return (
            trajectory.rollout_id, trajectory.attempt_id, trajectory.task_id, trajectory.group_id,
            trajectory.agent_name, trajectory.models[0] if trajectory.models else "", status,
            utc(trajectory.start_us), utc(trajectory.end_us), len(trajectory.spans), len(calls),
            len(calls) - len(trajectory.trainable_calls), trajectory.final_reward, trajectory.total_reward,
            trajectory.reward_dimensions, versions, utc(now_us()),
        )

    @staticmethod
    def _expired_row(row: tuple) -> tuple:
        expired = list(row)
        expired[ROLLOUT_COLUMNS.index("status")] = "EXPIRED"
        expired[ROLLOUT_COLUMNS.index("updated_at")] = utc(now_us())
        return tuple(expired)


async def read_spans(warehouse: Warehouse, database: str, rollout_ids: list[str]) -> dict[str, list[SpanNode]]:
    """The spans of these rollouts (every attempt), without token arrays, grouped by rollout id."""
    if not rollout_ids:
        return {}
    result = await warehouse.query(
        f"SELECT {SPAN_FIELDS} FROM {database}.rollout_spans FINAL WHERE rollout_id IN {{ids:Array(String)}}",
        {"ids": rollout_ids})
    spans: dict[str, list[SpanNode]] = {}
    for row in result.named_results():
        spans.setdefault(row["rollout_id"], []).append(span_node(row))
    return spans


TRANSITIONS_SQL = """
SELECT c.transition_id AS transition_id, c.rollout_id AS rollout_id, c.span_id AS span_id, c.agent_name AS agent_name,
       c.model AS model, ifNull(s.policy_version, 0) AS policy_version, c.step_index AS step_index,
       s.prompt_token_ids AS prompt_token_ids, s.response_token_ids AS response_token_ids,
       s.response_logprobs AS behaviour_logprobs, c.reward AS reward, c.return_value AS return_value,
       c.advantage AS advantage, c.group_id AS group_id, c.created_at_us AS created_at_us
FROM {database}.credit_staging AS c
INNER JOIN (SELECT rollout_id, span_id, policy_version, prompt_token_ids, response_token_ids, response_logprobs
            FROM {database}.rollout_spans FINAL
            WHERE rollout_id IN (SELECT rollout_id FROM {database}.credit_staging WHERE batch_id = {batch:String})
              AND has_token_ids) AS s
ON s.rollout_id = c.rollout_id AND s.span_id = c.span_id
WHERE c.batch_id = {batch:String} AND c.model = {model:String}
ORDER BY rollout_id, step_index
"""
STAGED_COLUMNS = ("batch_id", "transition_id", "rollout_id", "span_id", "agent_name", "model", "step_index", "reward",
                  "return_value", "advantage", "group_id", "created_at_us")
# Blocks of at most ~256 KB: each becomes one Kafka record, well under brokers' 1 MB default limit.
AVRO_OUTPUT = {"output_format_avro_codec": "null", "output_format_avro_sync_interval": 256 * 1024}


def staged_rows(batch: str, credited: list[tuple[Trajectory, list[Credit], Any]], created_us: int) -> list[tuple]:
    """One credit_staging row per credited call: the scalars ClickHouse joins with the call's token ids."""
    return [(batch, transition_id(trajectory.rollout_id, trajectory.attempt_id, credit.call.span_id),
             trajectory.rollout_id, credit.call.span_id, trajectory.agent_name, rule.train_as or credit.call.model,
             credit.step_index, credit.reward, credit.return_value, credit.advantage, trajectory.group_id or None,
             created_us)
            for trajectory, credits, rule in credited for credit in credits]


async def publish_transitions(processor: Stage, credited: list[tuple[Trajectory, list[Credit], Any]]) -> None:
    """Publish (one TransitionBatch per trained model, keyed by it) and store the transitions of credited trajectories.

    ClickHouse joins the credit with the token ids it already holds and writes both the
    transitions table and the Avro datums of the Kafka record: token arrays never pass
    through Python here.
    """
    created = now_us()
    batch = uuid.uuid4().hex
    rows = staged_rows(batch, credited, created)
    if not rows:
        return
    database = processor.database
    await processor.warehouse.insert_rows(f"{database}.credit_staging", STAGED_COLUMNS, rows)
    select = TRANSITIONS_SQL.replace("{database}", database)
    for model in sorted({row[5] for row in rows}):
        parameters = {"batch": batch, "model": model}
        container = await processor.warehouse.call("transitions", lambda client: client.raw_query(
            select + " FORMAT Avro", parameters=parameters, settings=AVRO_OUTPUT))
        count = 0
        rollouts = ",".join(sorted({row[2] for row in rows if row[5] == model}))
        for block_count, datums in container_blocks(container):
            body = processor.codec.header(TRANSITION_BATCH) + varint(block_count) + datums + b"\x00"
            await processor.emitter.send(processor.transitions_topic, model.encode(), body,
                                         headers=[("agentstream-rollouts", rollouts.encode())])
            count += block_count
        if count:
            await processor.warehouse.insert_container(f"{database}.transitions_ingest", container)
        processor.counters.transitions += count
        processor.counters.calls_without_tokens += sum(1 for row in rows if row[5] == model) - count
    await processor.emitter.flush()

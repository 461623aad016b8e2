"""The span processor: the spans topic in; ClickHouse rows, transitions and group results out.

Kafka Streams shape: a batch of the spans topic is ``read``, ``apply``-ed to the state and
``ingest``-ed into ClickHouse; ``tick()`` fires on a timer. They write to the outputs and
update explicit state (:class:`RolloutTracker`, which keeps every open rollout's spans, plus
the rollouts waiting for a late reward). Nothing
is acknowledged before what it produced is in ClickHouse and on Kafka, so a crash replays and
deterministic ids make the replay harmless.

    spans ─► spans_ingest (ClickHouse decodes the Avro into `spans`)
          ─► span reader (scalars; token arrays kept encoded) ─► rollout lifecycle
          ─► trajectory ─► credit ─┬► transitions topic, then the transitions table
                                   ├► rollouts table
                                   └► groups topic (grpo, keyed by group, with transition drafts)
    undecodable records ─► dlq topic

A transition holds one LLM call (token bytes copied); where a rule's ``level`` is "trajectory",
it holds successive calls that extend each other token for token (streams/trajectory_samples.py)
and the rollouts row counts the merges and breaks.

A rollout this worker saw from its STARTED event on is assembled from memory. Any other (one
first seen mid-way after a restart replayed from an earlier rollout's offset, one reopened by
a span that came after it was written out, one without events) and one whose late reward
arrived are assembled from the `spans` table, which holds every span it ever had, plus the
spans received that may not be stored yet.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agentstream.infra.config import Config, CreditRule
from agentstream.infra.kafka import topic_name
from agentstream.schemas import DEAD_LETTER, ROLLOUT_RESULT, AvroCodec
from agentstream.schemas.container_file import container_file, read_container
from agentstream.schemas.records import RolloutEventRecord
from agentstream.schemas.span_reader import MalformedSpan, SpanReader
from agentstream.schemas.transition_writer import Draft, draft
from agentstream.streams.clickhouse_io import RejectedData, Warehouse
from agentstream.streams.credit import Credit, NonFiniteCredit, matching_rule, strategy_for
from agentstream.streams.lifecycle import TERMINAL, OpenRollout, RolloutTracker
from agentstream.streams.records import RawRecord, sort_records
from agentstream.streams.sink import ROLLOUT_COLUMNS, Completion, CompletionSink, RolloutRow
from agentstream.streams.stage import Emitter, Holder, Stage, Transitions, now_us
from agentstream.streams.trajectory import SpanNode, Trajectory, assemble
from agentstream.streams.trajectory_samples import TrajectorySamples, trajectory_samples

log = logging.getLogger("agentstream.streams")

FAILED_STATUSES = {"FAILED", "TIMED_OUT", "CANCELLED"}

OPTED_OUT, OPTED_IN, NOT_TRAINED = "opted_out", "opted_in", "not_trained"
SAMPLED, SAMPLED_OUT = "sampled", "sampled_out"
TRAINED = frozenset({OPTED_IN, SAMPLED})
"""The ``training`` values of a rollouts row that produce transitions ('': the rollout failed or awaits a reward)."""
CLOSED_HORIZON = 2  # reward expiries an expired rollout stays closed to late rewards: as far back as restore() reads


def sample_point(key: str) -> float:
    """A point in [0, 1) fixed by ``key``: the same on every worker, process and replay (blake2b, not hash())."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def training_choice(trajectory: Trajectory, rule: CreditRule | None) -> str:
    """Whether a completed, rewarded rollout is trained on, and why (the ``training`` column of its row).

    No matching rule, or one with ``train = false``: ``not_trained``. Otherwise an explicit
    ``agentstream.train = false`` on any span wins (``opted_out``: evaluation traffic never
    trains), then ``true`` on any span (``opted_in``), then the rule's ``sample_rate`` decides on
    a hash of the group id, else the rollout id (``sampled`` / ``sampled_out``), so a GRPO group
    is kept or dropped whole and every worker and replay decides the same.
    """
    if rule is None or not rule.train:
        return NOT_TRAINED
    flags = {span.train for span in trajectory.spans}
    if False in flags:
        return OPTED_OUT
    if True in flags:
        return OPTED_IN
    if rule.sample_rate >= 1.0:
        return SAMPLED
    return SAMPLED if sample_point(trajectory.group_id or trajectory.rollout_id) < rule.sample_rate else SAMPLED_OUT


class Finished(NamedTuple):
    """A rollout to train on: its credits (None: its GRPO group credits it) and, at trajectory level, its samples."""

    trajectory: Trajectory
    credits: list[Credit] | None
    rule: CreditRule
    samples: TrajectorySamples | None  # None at transition level: one draft per call, made when it is emitted


@dataclass
class Awaiting:
    """A complete rollout with no reward yet: it waits (persisted as AWAITING_REWARD) until ``expires_at_s``."""

    row: RolloutRow  # its rollouts row, rewritten with status EXPIRED when the wait ends
    expires_at_s: float

    @property
    def attempt_id(self) -> str:
        return self.row.attempt_id


@dataclass
class Recheck:
    """What came for a waiting rollout since it was written: its new spans, and how it ended if its end came late."""

    spans: list[SpanNode] = field(default_factory=list)
    status: str = "SUCCEEDED"


def utc(us: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(us / 1e6, tz=datetime.UTC)


@dataclass
class SpanBatch:
    """A batch of the spans topic, read: each record's spans (token arrays still encoded), events, dead letters."""

    spans: dict[int, list[tuple[RawRecord, bytes, list[SpanNode]]]]  # by writer schema id
    schemas: dict[int, dict]
    in_order: list[tuple[RawRecord, list[SpanNode] | RolloutEventRecord]]  # spans and events, as the topic has them
    dead: list[tuple[RawRecord, Exception]]


class SpanProcessor(Stage[SpanBatch]):
    """spans topic → ClickHouse (spans, rollouts, transitions) + transitions/groups/dlq topics.

    State: ``tracker`` (open rollouts and their spans), ``awaiting`` (complete rollouts waiting
    for a late reward), ``recheck`` (those that got spans meanwhile), ``closed`` (expired ones).

    ``reads`` serves ticks (restore, spans of rollouts assembled from storage), ``span_writes``
    the span inserts; two connections, so neither waits for the other in this process.
    """

    def __init__(self, config: Config, reads: Warehouse, span_writes: Warehouse, emitter: Emitter, holder: Holder,
                 sink: CompletionSink, codec: AvroCodec | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, emitter, holder, sink, codec, clock)
        self.reads = reads
        self.span_writes = span_writes
        self.tracker = RolloutTracker(config.streams.grace_s, config.streams.idle_timeout_s)
        self.awaiting: dict[str, Awaiting] = {}
        # expired rollouts and when they closed: a reward after expiry does not revive them, for as long as
        # restore() would find them again (CLOSED_HORIZON expiries); then they are forgotten, so this stays bounded
        self.closed: dict[str, float] = {}
        self.recheck: dict[str, Recheck] = {}  # awaiting rollouts that got new spans or their end meanwhile
        self.next_expiry_s = float("inf")  # no waiting rollout expires before this
        self.readers: dict[int, SpanReader[SpanNode]] = {}
        # per batch applied and not inserted yet (ingest_interval_s), its spans by rollout: a read-back adds them
        self.unstored: dict[int, dict[str, list[SpanNode]]] = {}
        self.groups_topic = topic_name(config.topics, "streams.groups")
        self.dlq_topic = topic_name(config.topics, "dlq")

    async def restore(self) -> None:
        """Load the rollouts that wait for a late reward (or expired) from ClickHouse: state a replay cannot rebuild."""
        result = await self.reads.query(
            f"SELECT {', '.join(ROLLOUT_COLUMNS)} FROM {self.database}.rollouts "
            "FINAL WHERE status IN ('AWAITING_REWARD', 'EXPIRED') "
            "AND updated_at > now64(6) - toIntervalSecond({horizon:UInt64})",
            {"horizon": int(self.config.streams.reward_expiry_s * CLOSED_HORIZON)})
        wall, mono = time.time(), self.clock()
        for row in sorted(map(RolloutRow._make, result.result_rows), key=lambda row: row.updated_at):
            waited = wall - row.updated_at.timestamp()
            if row.status == "EXPIRED":
                self.closed[row.rollout_id] = mono - waited
            else:
                self.awaiting[row.rollout_id] = Awaiting(row, mono + self.config.streams.reward_expiry_s - waited)
        self.next_expiry_s = 0.0

    def read(self, records: list[RawRecord]) -> SpanBatch:
        """Sort a batch and read its spans; a record that cannot be read is set aside as a dead letter."""
        sorted_records = sort_records(records, self.codec)
        spans: dict[int, list[tuple[RawRecord, bytes, list[SpanNode]]]] = {}
        for schema_id, items in sorted_records.span_bodies.items():
            reader = self._reader(schema_id, sorted_records.schemas[schema_id])
            for record, body in items:
                try:
                    spans.setdefault(schema_id, []).append((record, body, reader.batch(body)))
                except MalformedSpan as error:
                    sorted_records.dead.append((record, error))
        self.counters.records += len(records)
        payloads: dict[int, list[SpanNode] | RolloutEventRecord] = {id(record): event
                                                                    for record, event in sorted_records.events}
        payloads.update((id(record), nodes) for read in spans.values() for record, _, nodes in read)
        in_order = [(record, payloads[id(record)]) for record in records if id(record) in payloads]
        return SpanBatch(spans, sorted_records.schemas, in_order, sorted_records.dead)

    def apply(self, batch: SpanBatch) -> None:
        """Take a read batch into the state: spans to their open rollouts, events to the lifecycle.

        This comes before the batch is stored: a rollout may be completed (and its first record
        released) meanwhile, but the batch's own records are acknowledged only after ``ingest``,
        so no commit passes a span that is not in ClickHouse.
        """
        now = self.clock()
        unstored: dict[str, list[SpanNode]] = {}
        for record, payload in batch.in_order:
            if isinstance(payload, dict):
                self._apply_event(record, payload, now)
                continue
            # sort_records dead-letters a span record without a key, so it is bytes here (no per-span check)
            rollout_id = record.key.decode("utf-8", "replace")  # type: ignore[union-attr]
            unstored.setdefault(rollout_id, []).extend(payload)
            self.counters.spans_records += 1
            if rollout_id in self.awaiting:
                self.recheck.setdefault(rollout_id, Recheck()).spans.extend(payload)
            elif rollout_id not in self.closed and self.tracker.on_spans(rollout_id, record, now, payload):
                self.holder.hold(record)
        if unstored:
            self.unstored[id(batch)] = unstored

    def _apply_event(self, record: RawRecord, event: RolloutEventRecord, now: float) -> None:
        self.counters.events += 1
        rollout_id, kind = event["rollout_id"], event["event"]
        if rollout_id in self.closed:
            return
        if kind == "HEARTBEAT" and rollout_id not in self.tracker.open:
            return  # it keeps an open rollout alive; alone it opens none (one may trail its rollout's end)
        waiting = self.awaiting.get(rollout_id)
        if waiting is not None and kind in TERMINAL and event["attempt_id"] == waiting.attempt_id:
            # the end of the attempt that waits, later than the silence that closed it: look again, as it ended
            self.recheck.setdefault(rollout_id, Recheck()).status = kind
            return
        self.awaiting.pop(rollout_id, None)  # a new attempt supersedes the wait
        self.recheck.pop(rollout_id, None)
        if self.tracker.on_event(event, record, now):
            self.holder.hold(record)

    async def ingest(self, batches: list[SpanBatch]) -> None:
        """Store the batches' spans in ClickHouse (one insert per writer schema) and send their dead letters."""
        spans: dict[int, list[tuple[RawRecord, bytes, list[SpanNode]]]] = {}
        schemas: dict[int, dict] = {}
        dead = [item for batch in batches for item in batch.dead]
        for batch in batches:
            schemas.update(batch.schemas)
            for schema_id, read in batch.spans.items():
                spans.setdefault(schema_id, []).extend(read)
        await self._ingest_spans(spans, schemas, dead)
        for batch in batches:
            self.unstored.pop(id(batch), None)
        for record, error in dead:
            await self._dead_letter(record, error)
        if dead:
            await self.emitter.flush()

    def _reader(self, schema_id: int, schema: dict) -> SpanReader[SpanNode]:
        reader = self.readers.get(schema_id)
        if reader is None:
            reader = self.readers[schema_id] = SpanReader(schema, SpanNode)
        return reader

    async def _ingest_spans(self, spans: dict[int, list[tuple[RawRecord, bytes, list[SpanNode]]]],
                            schemas: dict[int, dict], dead: list[tuple[RawRecord, Exception]]) -> None:
        """Insert span bodies, one container file per writer schema."""
        for schema_id, read in spans.items():
            try:
                await self.span_writes.insert_container(f"{self.database}.spans_ingest",
                                                        container_file(schemas[schema_id], [b for _, b, _ in read]))
            except RejectedData:
                await self._ingest_one_by_one([(record, body) for record, body, _ in read], schemas[schema_id], dead)

    async def _ingest_one_by_one(self, items: list[tuple[RawRecord, bytes]], schema: dict,
                                 dead: list[tuple[RawRecord, Exception]]) -> None:
        """The slow path after ClickHouse refused a batch: find the records it refuses, dead-letter only those.

        Their spans are already in the state; the transitions they lead to are kept (the dead
        letter holds the record for whoever fixes what ClickHouse refused)."""
        for record, body in items:
            try:
                await self.span_writes.insert_container(f"{self.database}.spans_ingest", container_file(schema, [body]))
            except RejectedData as error:
                dead.append((record, error))

    async def _dead_letter(self, record: RawRecord, error: Exception) -> None:
        self.counters.dead_letters += 1
        log.warning("dead letter from %s[%d]@%d: %s", record.topic, record.partition, record.offset, error)
        await self.emitter.send(self.dlq_topic, record.key, self.codec.encode(DEAD_LETTER, {
            "source_topic": record.topic, "partition": record.partition, "offset": record.offset, "key": record.key,
            "value": bytes(record.value or b""),  # a tombstone has no value: its dead letter holds empty bytes
            "error": str(error), "error_type": type(error).__name__, "at_us": now_us(),
        }))

    async def tick(self) -> None:
        """Complete the rollouts that are due, re-check the ones a late reward arrived for, expire the stale."""
        now = self.clock()
        due = self.tracker.pop_due(now)
        rechecked, self.recheck = self.recheck, {}
        expired = self._expired(now, rechecked)
        self._forget_closed(now)
        if not (due or rechecked or expired):
            return
        stored_ids = [rollout.rollout_id for rollout in due if not rollout.seen_from_start] + list(rechecked)
        stored = self._with_unstored(await read_stored_spans(self.reads, self.database, stored_ids)
                                     if stored_ids else {}, stored_ids)
        self.counters.rollouts_read_back += len(stored_ids)
        rows: list[RolloutRow] = []
        finished: list[Finished] = []
        for rollout in due:
            spans = (rollout.spans if rollout.seen_from_start
                     else union(stored.get(rollout.rollout_id, []), rollout.spans))
            trajectory = assemble(rollout.rollout_id, spans, self._status_of(rollout), rollout.attempt_id,
                                  rollout.error)
            rows.append(self._decide(trajectory, finished, now))
        for rollout_id, came in rechecked.items():
            waiting = self.awaiting.pop(rollout_id)
            trajectory = assemble(rollout_id, union(stored.get(rollout_id, []), came.spans), came.status,
                                  waiting.attempt_id)
            rows.append(self._decide(trajectory, finished, now))
        for rollout_id in expired:
            waiting = self.awaiting.pop(rollout_id)
            self.closed[rollout_id] = now
            self.counters.rollouts_expired += 1
            rows.append(self._expired_row(waiting.row))
        datums = await self._emit_transitions(finished)
        await self.sink.put(Completion(rows, datums, [rollout.held for rollout in due]))

    def _with_unstored(self, stored: dict[str, list[SpanNode]], rollout_ids: list[str]) -> dict[str, list[SpanNode]]:
        """Spans read back from ClickHouse, and those of these rollouts applied but not inserted yet.

        A rollout is read back when it was cut (a silence, a late end event); its spans of the last
        ``ingest_interval_s`` may still wait for their insert, and without them a late end event
        rewrote a whole rollout as the fragment ClickHouse held.
        """
        for by_rollout in self.unstored.values():
            for rollout_id in rollout_ids:
                if rollout_id in by_rollout:
                    stored[rollout_id] = union(stored.get(rollout_id, []), by_rollout[rollout_id])
        return stored

    def _expired(self, now: float, rechecked: dict[str, Recheck]) -> list[str]:
        """The waiting rollouts whose wait is over; the scan runs only once the earliest expiry has come."""
        if now < self.next_expiry_s:
            return []
        expired, self.next_expiry_s = [], float("inf")
        for rollout_id, waiting in self.awaiting.items():
            if rollout_id in rechecked:
                continue
            if waiting.expires_at_s <= now:
                expired.append(rollout_id)
            else:
                self.next_expiry_s = min(self.next_expiry_s, waiting.expires_at_s)
        return expired

    def _forget_closed(self, now: float) -> None:
        """Forget the rollouts that closed longer ago than restore() looks back (oldest first, in closing order)."""
        horizon = now - self.config.streams.reward_expiry_s * CLOSED_HORIZON
        while self.closed and next(iter(self.closed.values())) < horizon:
            del self.closed[next(iter(self.closed))]

    def _status_of(self, rollout: OpenRollout) -> str:
        if rollout.terminal:
            return rollout.terminal
        return "TIMED_OUT" if rollout.managed else "COMPLETED"

    def _decide(self, trajectory: Trajectory, finished: list[Finished], now: float) -> RolloutRow:
        """Route one assembled rollout: not trainable, waiting for a reward, not selected for training (see
        :func:`training_choice`), grouped (credits None), or credited now. Every one gets its rollouts row, with
        its prefix merges and breaks where its rule trains at trajectory level."""
        status = trajectory.status
        self.counters.calls_without_tokens += len(trajectory.llm_calls) - len(trajectory.trainable_calls)
        if status in FAILED_STATUSES or not trajectory.spans:
            self.counters.rollouts_completed += 1
            return self._rollout_row(trajectory, status)
        if not trajectory.rewards:
            self.counters.rollouts_awaiting_reward += 1
            row = self._rollout_row(trajectory, "AWAITING_REWARD")
            self.awaiting[trajectory.rollout_id] = Awaiting(row, now + self.config.streams.reward_expiry_s)
            self.next_expiry_s = min(self.next_expiry_s, now + self.config.streams.reward_expiry_s)
            return row
        self.counters.rollouts_completed += 1
        model = trajectory.models[0] if trajectory.models else ""
        rule = matching_rule(self.config.credit, trajectory.agent_name, model)
        training = training_choice(trajectory, rule)
        if rule is None or training not in TRAINED:
            self.counters.rollouts_not_selected += 1
            return self._rollout_row(trajectory, status, training)
        credits = None
        if not (strategy_for(rule).grouped and trajectory.group_id):
            try:
                credits = strategy_for(rule).assign(trajectory)
            except NonFiniteCredit as error:  # a NaN reward read back from storage, or a return that overflows
                self.counters.credits_refused += 1
                log.warning("no transitions from %s: %s", trajectory.rollout_id, error)
                return self._rollout_row(trajectory, status, training)
        samples = trajectory_samples(trajectory, rule, credits) if rule.level == "trajectory" else None
        if samples is not None:
            self.counters.prefix_merges += samples.merges
            self.counters.prefix_breaks += samples.breaks
        finished.append(Finished(trajectory, credits, rule, samples))
        return self._rollout_row(trajectory, status, training, samples)

    async def _emit_transitions(self, finished: list[Finished]) -> list[bytes]:
        """Send the group results and the transitions to Kafka; returns the transitions for ClickHouse."""
        created = now_us()
        transitions = Transitions()
        drafts, datums = transitions.drafts, transitions.datums
        for trajectory, credits, rule, samples in finished:
            if credits is not None:  # credited alone: no group the advantage was centred on (the rollout row has it)
                if samples is None:
                    for credit in credits:
                        pending = draft_of(trajectory, rule, credit.call, credit.step_index)
                        drafts.append(pending)
                        datums.append(pending.complete(credit.reward, credit.return_value, credit.advantage, None,
                                                       created))
                    continue
                for pending, credit in zip(samples.drafts, samples.credits, strict=True):  # each sample's first call's
                    drafts.append(pending)
                    datums.append(pending.complete(credit.reward, credit.return_value, credit.advantage, None,
                                                   created))
                continue
            self.counters.group_results += 1
            group_drafts = samples.drafts if samples is not None else [
                draft_of(trajectory, rule, call, index) for index, call in enumerate(trajectory.trainable_calls)]
            await self.emitter.send(self.groups_topic, trajectory.group_id.encode(), self.codec.encode(ROLLOUT_RESULT, {
                "rollout_id": trajectory.rollout_id, "attempt_id": trajectory.attempt_id,
                "group_id": trajectory.group_id, "agent_name": trajectory.agent_name, "status": trajectory.status,
                "final_reward": trajectory.final_reward, "completed_at_us": created,
                "drafts": [{"model": d.model, "head": d.head} for d in group_drafts]}))
        await self.publish_transitions(transitions)
        return datums

    def _rollout_row(self, trajectory: Trajectory, status: str, training: str = "",
                     samples: TrajectorySamples | None = None) -> RolloutRow:
        calls = trajectory.llm_calls
        versions = sorted({c.policy_version for c in calls if c.policy_version is not None})
        return RolloutRow(
            rollout_id=trajectory.rollout_id, attempt_id=trajectory.attempt_id, task_id=trajectory.task_id,
            group_id=trajectory.group_id, agent_name=trajectory.agent_name,
            model=trajectory.models[0] if trajectory.models else "", status=status,
            start_time=utc(trajectory.start_us), end_time=utc(trajectory.end_us), span_count=len(trajectory.spans),
            llm_calls=len(calls), llm_calls_without_tokens=len(calls) - len(trajectory.trainable_calls),
            final_reward=trajectory.final_reward, total_reward=trajectory.total_reward,
            reward_dimensions=trajectory.reward_dimensions, policy_versions=versions, updated_at=utc(now_us()),
            training=training, prefix_merges=samples.merges if samples else 0,
            prefix_breaks=samples.breaks if samples else 0,
        )

    @staticmethod
    def _expired_row(row: RolloutRow) -> RolloutRow:
        return row._replace(status="EXPIRED", updated_at=utc(now_us()))


def draft_of(trajectory: Trajectory, rule: Any, call: SpanNode, step_index: int) -> Draft:
    """The draft transition of one trainable call, keyed by the model it trains."""
    return draft(trajectory.rollout_id, trajectory.attempt_id, trajectory.agent_name, rule.train_as or call.model,
                 step_index, call)


STORED_SPANS_SQL = """
SELECT span_id, rollout_id, attempt_id, parent_id, name, kind, toUnixTimestamp64Micro(start_time) AS start_time_us,
       toUnixTimestamp64Micro(end_time) AS end_time_us, status, agent_name, task_id, group_id, model,
       prompt_token_ids, response_token_ids, response_logprobs, reward, reward_dimensions, policy_version,
       mapFilter((k, v) -> k = 'agentstream.train', attributes) AS attributes
FROM {database}.spans FINAL
WHERE rollout_id IN {ids:Array(String)}
FORMAT Avro
"""
# Rows named and typed like Span fields, so the span reader walks them; strings as Avro strings, not bytes.
# Of the attributes only the training flag (agentstream.train) comes back: the reader reads nothing else there.
STORED_SPANS_SETTINGS = {"output_format_avro_codec": "null", "output_format_avro_string_column_pattern": ".*"}


async def read_stored_spans(warehouse: Warehouse, database: str, rollout_ids: list[str]) -> dict[str, list[SpanNode]]:
    """Every stored span of these rollouts (every attempt), token arrays still encoded, grouped by rollout id."""
    container = await warehouse.call("stored spans", lambda client: client.raw_query(
        STORED_SPANS_SQL.replace("{database}", database), parameters={"ids": rollout_ids},
        settings=STORED_SPANS_SETTINGS))
    spans: dict[str, list[SpanNode]] = {}
    if not container:
        return spans
    schema, blocks = read_container(container)
    reader = SpanReader(schema, SpanNode)
    for count, datums in blocks:
        for node in reader.rows(count, datums):
            spans.setdefault(node.rollout_id, []).append(node)
    return spans


def union(stored: list[SpanNode], received: list[SpanNode]) -> list[SpanNode]:
    """Spans from ClickHouse plus those received since that it may not hold yet, each (attempt, span id) once."""
    seen = {(node.attempt_id, node.span_id) for node in stored}
    return stored + [node for node in received if (node.attempt_id, node.span_id) not in seen]

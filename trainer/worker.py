"""The trainer process: consume one model's transitions, take steps, checkpoint, announce, and only then commit offsets.

One worker trains one model, as the only member of the consumer group
``agentstream-trainer-{model}`` on the transitions topic (a record is a Transition or a
TransitionBatch; records keyed by other models are skipped). Offsets are committed only
after the checkpoint holding every step that used them is written and announced, and the
checkpoint's manifest carries the same positions, so a restart resumes from whichever is
further: after a crash, exactly the transitions behind the last checkpoint are read again.
Transition ids dedupe replays: within a run every id taken for training is remembered, and
across restarts the ids of the newest checkpoints (up to ``dedupe_window``) are loaded back,
so a transition that a replay upstream re-emitted at a new offset is not trained twice either.

No NaN reaches a checkpoint: a batch whose loss or gradient norm is not finite is skipped (no
optimizer step; counted in the next ``train_steps`` row as ``skipped_nonfinite``, and logged),
and weights that are not finite anyway are never written: that checkpoint is refused
(``NonFiniteWeights``, logged) and training goes on from the newest checkpoint's weights, the
last good ones; with no checkpoint to go back to, the worker stops with that error.

With a ``group`` (``trainer/distributed.py``) this worker is rank 0 of data-parallel ranks: it
alone reads Kafka and writes checkpoints, and each step runs on every rank; after each load of
weights (resume, rebase, back to the last good ones) the other ranks get rank 0's copy.

It is one module of about 500 lines on purpose: the order of consume, step, checkpoint, announce and commit is
the trainer's argument for exactly-once training, and it reads best in one place.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from agentstream.infra.config import Config
from agentstream.infra.gaps import GapGuard
from agentstream.infra.kafka import client_options, consumer_options, session_timeout_checked, topic_name
from agentstream.infra.logreset import ConsumerLogWatch
from agentstream.infra.members import MemberLedger, evict_dead_members, member_id
from agentstream.models import NonFiniteWeights
from agentstream.schemas import TRANSITION, TRANSITION_BATCH, AvroCodec, CodecError
from agentstream.trainer.batching import Batch, Batcher, Sample, SeenIds, TransitionError
from agentstream.trainer.checkpoint_writer import (
    CheckpointAnnouncer,
    CheckpointError,
    CheckpointStore,
    Manifest,
    latest_manifest,
    open_store,
    prune,
    recent_trained_ids,
    write_checkpoint,
)
from agentstream.trainer.errors import TrainerConfigError
from agentstream.trainer.metrics import MetricsWriter, StepReport, write_logged
from agentstream.trainer.policy import (
    OPTIMIZER_STATE,
    Policy,
    PolicyError,
    Written,
    build_policy,
    load_weights,
    restore_last_good,
    save_weights_later,
)
from agentstream.trainer.standby import ModelLock
from agentstream.trainer.step import StepResult, train_step
from agentstream.trainer.tracking import Tracker

if TYPE_CHECKING:
    from agentstream.trainer.distributed import Group

log = logging.getLogger("agentstream.trainer")


class ServingVersion(Protocol):
    """The version serving users, which a rebase goes back to."""

    @property
    def stable_version(self) -> int: ...

    @property
    def stable_uri(self) -> str: ...


class Rebase(Protocol):
    """Says when the gate has refused ``limit`` of this model's candidates in a row
    (``agentstream.deploy.rebase.RejectionStreak``).

    The trainer and ``deploy`` do not import each other (they talk through Kafka): whoever
    starts the trainer hands it the factory, ``RejectionStreak``, that follows the deployments topic.
    """

    limit: int

    async def follow(self, config: Config, bootstrap_servers: str, stop: asyncio.Event) -> None: ...

    def due(self, version: int | None = None, max_lag: int | None = None) -> ServingVersion | None: ...

    def clear(self) -> list[int]: ...

METRICS_FLUSH_S = 1.0  # train_steps rows are written in batches, off the training path


@dataclass
class RunSummary:
    """What a run of the worker did."""

    steps: int = 0
    checkpoints: int = 0
    transitions: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    rebases: int = 0
    skipped_nonfinite: int = 0  # batches whose loss or gradient norm was not finite: no optimizer step
    below_threshold: int = 0  # supervised: transitions not trained, their rollout's reward below the threshold
    refused_checkpoints: int = 0  # checkpoints not written because a weight was not finite
    first_record_at: float | None = None
    last_step_at: float | None = None
    tracking_failures: int = 0  # experiment tracker calls that failed (trainer/tracking.py)
    tracking_dropped: int = 0  # and those dropped because its queue was full or it did not finish in time


class _ResumePositions(ConsumerRebalanceListener):
    """On assignment, start each partition at the later of its committed offset and the checkpoint's position."""

    def __init__(self, worker: TrainerWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked) -> None:
        self.worker.ledger.mark_rejoining()

    async def on_partitions_assigned(self, assigned) -> None:
        consumer, watch = self.worker.consumer, self.worker.log_watch
        assert consumer is not None and watch is not None  # the consumer this listener was subscribed with
        joined = member_id(consumer)
        if joined:
            self.worker.ledger.record(joined)
        await self.worker.resumed.wait()  # the first join runs while the checkpoint loads
        for tp in assigned:
            watch.moved(tp, None)
            self.worker.gaps.forget(tp)
            checkpointed = self.worker.resume_offsets.get(f"{tp.topic}:{tp.partition}")
            if checkpointed is None:
                continue
            committed = await consumer.committed(tp)
            if committed is None or committed < checkpointed:
                consumer.seek(tp, checkpointed)
                watch.moved(tp, checkpointed)  # a wiped log ends below it: the watch notices and starts over


class TrainerWorker:
    """Trains ``config.trainer`` from the transitions topic; ``run`` until stopped or ``max_steps`` steps were taken.

    ``rebase`` makes the streak of refused candidates from the model's name and
    ``trainer.rebase_after_rejections``; it is required when that setting is above 0.
    """

    def __init__(self, config: Config, bootstrap_servers: str, *, metrics: MetricsWriter | None = None,
                 progress: Callable[[str], None] = print, policy: Policy | None = None,
                 store: CheckpointStore | None = None, rebase: Callable[[str, int], Rebase] | None = None,
                 group: Group | None = None) -> None:
        if rebase is None and config.trainer.rebase_after_rejections > 0:
            raise TrainerConfigError("trainer.rebase_after_rejections needs the deployments topic: pass "
                                     "rebase=deploy.rebase.RejectionStreak")
        self.config = config
        self.settings = config.trainer
        self.bootstrap_servers = bootstrap_servers
        self.metrics = metrics
        self.progress = progress
        self.policy = policy or build_policy(self.settings)
        self.group = group
        self.name = self.policy.name
        self.checkpoint_dir = self.settings.checkpoint_dir or str(config.stack.home / "checkpoints")
        self.store = store or open_store(self.checkpoint_dir, config.checkpoints, config.stack.home)
        self.tracker = Tracker(config.tracking)
        self.codec = AvroCodec()
        self.announcer = CheckpointAnnouncer(config, bootstrap_servers)
        self.consumer: AIOKafkaConsumer | None = None
        self.log_watch: ConsumerLogWatch | None = None
        self.ledger = MemberLedger(config.stack.home, f"agentstream-trainer-{self.name}")
        self.gaps = GapGuard(f"trainer {self.name}", config.kafka.read_gap_patience_s)
        self.lock = ModelLock(config.stack.home, self.name)
        self.resumed = asyncio.Event()  # set once _resume has set the positions the first assignment seeks to
        self.version = 0
        self.step = 0
        self.resume_offsets: dict[str, int] = {}
        self.summary = RunSummary()
        self._consumed: dict[TopicPartition, int] = {}  # next offset per partition
        self._committed: dict[TopicPartition, int] = {}
        self._trained_since: list[str] = []
        self._steps_since = 0
        self._last_report: StepReport | None = None
        self._skipped_nonfinite = 0  # batches skipped since the last step that was taken
        self._reports: list[StepReport] = []
        self._flushed_at = 0.0
        self._writes: set[asyncio.Task] = set()
        self._writing: asyncio.Task | None = None  # the checkpoint being written while the next step runs
        self._metrics_lock = asyncio.Lock()
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-model")
        self.batcher = self._batcher([])
        self.streak = rebase(self.name, self.settings.rebase_after_rejections) if rebase is not None else None
        self._rebased_on: int | None = None  # the version the next checkpoint was rebased on, if any

    def _batcher(self, trained_ids: list[str]) -> Batcher:
        return Batcher.for_trainer(self.settings, SeenIds(self.settings.dedupe_window, trained_ids))

    async def run(self, stop: asyncio.Event | None = None, max_steps: int | None = None) -> RunSummary:
        """Resume from the latest checkpoint, train until ``stop`` is set, write a last checkpoint on the way out."""
        stop = stop or asyncio.Event()
        await self.announcer.start()
        following = asyncio.Event()
        follower = (asyncio.create_task(self.streak.follow(self.config, self.bootstrap_servers, following))
                    if self.streak is not None and self.streak.limit > 0 else None)
        try:
            if not await self.lock.take(stop, self.progress):
                return self.summary  # stopped while standing by
            resuming = asyncio.create_task(self._resume())
            resuming.add_done_callback(lambda _: self.resumed.set())
            options = client_options(self.config.kafka, self.bootstrap_servers)
            await evict_dead_members(options, self.ledger)  # a crashed predecessor would hold the partitions a session
            self.consumer = AIOKafkaConsumer(
                **consumer_options(self.config.kafka, self.bootstrap_servers), group_id=self.ledger.group,
                enable_auto_commit=False, auto_offset_reset="earliest", heartbeat_interval_ms=500,
                session_timeout_ms=int(self.settings.session_timeout_s * 1000), max_poll_interval_ms=24 * 3600 * 1000)
            self.log_watch = ConsumerLogWatch("trainer", self.consumer)
            self.consumer.subscribe([topic_name(self.config.topics, "transitions")], listener=_ResumePositions(self))
            try:
                try:
                    with session_timeout_checked("[trainer] session_timeout_s", self.settings.session_timeout_s):
                        await self.consumer.start()  # it waits for the first join's answer
                finally:
                    await resuming  # its failure is raised here, before any record is read
                if tracking := self.tracker.start(self.settings, self.name, self.version, self.checkpoint_dir):
                    self.progress(tracking)
                await self._sync()
                await self._consume(stop, max_steps)
                if self._steps_since:
                    await self._checkpoint()
                await self._written()
                if self.group is not None:
                    await self._on_model_thread(self.group.stop)
            finally:
                if self._writing is not None:  # failed on the way: the checkpoint's records are read again
                    self._writing.cancel()
                self._flush_metrics()
                await asyncio.gather(*self._writes)
                await self.consumer.stop()
        finally:
            following.set()
            if follower is not None:
                await follower
            await self.announcer.stop()
            self.lock.release()
            self._model_thread.shutdown()
            await asyncio.to_thread(self.tracker.finish)
            self.summary.tracking_failures, self.summary.tracking_dropped = self.tracker.failures, self.tracker.dropped
        return self.summary

    def unfinished(self) -> str:
        """What a forced exit abandons, for its log line (read from another thread: plain reads only)."""
        writing = f" (v{self.version} was still being written)" if self._writing is not None else ""
        return (f"{self._steps_since} steps since checkpoint v{self.version}{writing} and {len(self.batcher)} queued "
                f"transitions (their offsets were not committed: they are trained again from the last checkpoint)")

    async def _on_model_thread(self, function: Callable, *args: Any) -> Any:
        """Run model work off the event loop, always on the same thread (torch keeps per-thread state)."""
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, function, *args)

    async def _resume(self) -> None:
        """Load the latest checkpoint (weights, optimizer, version, step, positions, trained ids) and announce it again.

        Announcing again is harmless (servers ignore versions they have) and covers a crash
        between writing a checkpoint and announcing it.
        """
        manifest = latest_manifest(self.store, self.name)
        if manifest is None:
            self.progress(f"trainer {self.name}: no checkpoint yet, starting from {self.settings.model} at version 0")
            return
        folder = await asyncio.to_thread(self.store.get, manifest.uri)
        await self._on_model_thread(load_weights, self.policy, folder)
        if not (folder / OPTIMIZER_STATE).is_file():
            self.progress(f"trainer {self.name}: version {manifest.version} was written without the optimizer state "
                          "(trainer.optimizer_state_every): AdamW's moments start afresh")
        self.version, self.step, self.resume_offsets = manifest.version, manifest.step, dict(manifest.offsets)
        self.batcher = self._batcher(recent_trained_ids(self.store, self.name, self.settings.dedupe_window))
        await self._announce(manifest)
        self.progress(f"trainer {self.name}: resumed from version {manifest.version} (step {manifest.step}) at "
                      f"{manifest.uri}")

    async def _sync(self) -> None:
        """Give the other ranks, if any, this rank's weights and optimizer state."""
        if self.group is not None:
            await self._on_model_thread(self.group.sync)

    async def _consume(self, stop: asyncio.Event, max_steps: int | None) -> None:
        assert self.consumer is not None and self.log_watch is not None  # run() starts it first
        key = self.name.encode()
        while not stop.is_set() and (max_steps is None or self.summary.steps < max_steps):
            fetched = await self.consumer.getmany(timeout_ms=100, max_records=4096)
            for reset in await self.log_watch.check(fetched):
                self._start_over(TopicPartition(reset.topic, reset.partition))
            now, wall = time.monotonic(), time.time()
            for tp, records in fetched.items():
                for record in records:
                    again = self.gaps.admit(tp, record.offset, f"{tp.topic}[{tp.partition}]")
                    if again is not None:  # past a hole (infra/gaps.py): read again from it
                        self.consumer.seek(tp, again)
                        self.gaps.expect(tp, again)
                        break
                    self._consumed[tp] = record.offset + 1
                    if record.key == key:
                        self._offer(record, tp, now, wall)
            if self.streak is not None and (
                    routing := self.streak.due(self.version, self.settings.max_policy_lag)) is not None:
                await self._rebase(routing, self.streak.clear())
            # a batch per fetch: what was published during a step is read before a part batch closes on time
            if (self.batcher.ready(time.monotonic()) and not stop.is_set()
                    and (max_steps is None or self.summary.steps < max_steps)):
                batch = self.batcher.take(self.version)
                if batch is not None:
                    await self._train(batch)
                if self._steps_since >= self.settings.checkpoint_every_steps:
                    await self._checkpoint()
            if self._writing is not None and self._writing.done():
                await self._written()  # a failed write is raised here, not a step later
            if not self._steps_since and self._writing is None:  # all trained is announced: commit what was skipped
                await self._commit(self._committable())
            if self.group is not None and self.group.idle_s() > self.group.keepalive_s:
                await self._on_model_thread(self.group.keepalive)

    def _start_over(self, tp: TopicPartition) -> None:
        """A log reset: forget ``tp``'s old positions (consumed, committed, checkpointed) so none is committed again.

        The transitions read again are not trained twice: their ids are in the batcher's seen
        set (this run) or in the recent checkpoints' trained ids it was loaded with.
        """
        self._consumed.pop(tp, None)
        self._committed.pop(tp, None)
        self.gaps.forget(tp)
        self.resume_offsets.pop(f"{tp.topic}:{tp.partition}", None)

    def _offer(self, record, tp: TopicPartition, now: float, wall: float) -> None:
        """Queue the transitions of one record: a Transition, or a TransitionBatch (all share the record's offset).

        A record counts as arrived when it was published (its timestamp), so the backlog a
        restarted trainer reads has used up its batch wait and is trained at once.
        """
        if self.summary.first_record_at is None:
            self.summary.first_record_at = now
        arrived = now - max(0.0, wall - record.timestamp / 1000) if record.timestamp > 0 else now
        position = (tp.topic, tp.partition, record.offset)
        try:
            name, value = self.codec.decode(record.value or b"")
        except CodecError as error:
            self.batcher.counts.invalid += 1
            log.warning("skipped the record at %s:%d@%d: %.200s", *position, error)
            return
        if name not in (TRANSITION, TRANSITION_BATCH):
            self.batcher.counts.invalid += 1
            log.warning("skipped the record at %s:%d@%d: a %s, not transitions", *position, name)
            return
        for item in value["transitions"] if name == TRANSITION_BATCH else [value]:
            try:
                self.batcher.offer(Sample.from_record(item, position), self.version, arrived)
            except TransitionError as error:
                self.batcher.counts.invalid += 1
                log.warning("skipped a transition at %s:%d@%d: %s", *position, error)

    async def _train(self, batch: Batch) -> None:
        result: StepResult = await (self._on_model_thread(self.group.step, batch) if self.group is not None
                                    else self._on_model_thread(train_step, self.policy, batch, self.settings))
        if result.skipped:
            self._skipped_nonfinite += 1
            self.summary.skipped_nonfinite += 1
            log.warning("trainer %s: skipped a batch of %d transitions: loss %r, gradient norm %r (not finite); "
                        "weights and optimizer state unchanged", self.name, result.transitions, result.loss,
                        result.grad_norm)
            self.progress(f"step skipped: loss {result.loss} |g| {result.grad_norm} not finite "
                          f"({self.summary.skipped_nonfinite} skipped in this run)")
            return
        self.step += 1
        self._steps_since += 1
        self._trained_since.extend(s.transition_id for s in batch.samples)
        report = self._last_report = StepReport.of(self.name, self.step, batch, result, self._skipped_nonfinite)
        self._skipped_nonfinite = 0
        self.summary.steps += 1
        self.summary.transitions += result.transitions
        self.summary.below_threshold += batch.counts.below_threshold
        self.summary.tokens += result.tokens
        self.summary.train_seconds += result.seconds
        self.summary.last_step_at = time.monotonic()
        self.progress(report.line())
        self.tracker.step(report)
        self._reports.append(report)
        if time.monotonic() - self._flushed_at >= METRICS_FLUSH_S:
            self._flush_metrics()

    async def _rebase(self, routing: ServingVersion, refused: list[int]) -> None:
        """Train on from the serving version's weights (and optimizer state, where it was written); versions count on.

        Steps since the last checkpoint are dropped with the weights they changed; their
        transitions still count as trained. A serving checkpoint that cannot be loaded (pruned,
        unreadable) leaves the trainer on its own weights, and the streak starts again.
        """
        try:
            folder = await asyncio.to_thread(self.store.get, routing.stable_uri)
            await self._on_model_thread(load_weights, self.policy, folder)
            await self._sync()
        except (CheckpointError, PolicyError, OSError) as error:
            log.error("could not go back to %s v%d after %d refused candidates: %s", self.name,
                      routing.stable_version, len(refused), error)
            await self._sync()  # a load that failed halfway may have changed some of this rank's weights
            return
        self._rebased_on = routing.stable_version
        self.summary.rebases += 1
        self.progress(f"trainer {self.name}: back to v{routing.stable_version}, the version serving, after the gate "
                      f"refused {len(refused)} candidates in a row ({', '.join(f'v{v}' for v in refused)}) at "
                      f"v{self.version}; training on from its weights as v{self.version + 1}")

    async def _checkpoint(self) -> None:
        """Copy the weights as the next version, then write, announce and commit it while the next step runs.

        One checkpoint is in flight at a time, so versions are announced, and their positions
        committed, in order. A crash before the announcement loses only that version: its
        transitions are read again from the previous checkpoint's positions.
        """
        await self._written()
        positions = self._committable()
        staging = self.store.staging()
        every = self.settings.optimizer_state_every
        version = self.version + 1
        try:
            write = await self._on_model_thread(save_weights_later, self.policy, staging,
                                                every > 0 and version % every == 0)
        except NonFiniteWeights as error:
            shutil.rmtree(staging, ignore_errors=True)
            await self._back_to_last_good(version, error)
            return
        metrics = self._last_report.checkpoint_metrics() if self._last_report else {}
        if self._rebased_on is not None:
            metrics["rebased_on_version"], self._rebased_on = float(self._rebased_on), None
        trained_ids, self._trained_since, self._steps_since = self._trained_since, [], 0
        self.version = version
        self._writing = asyncio.create_task(self._write(write, staging, version, self.step, positions, trained_ids,
                                                        metrics))

    async def _back_to_last_good(self, version: int, error: NonFiniteWeights) -> None:
        """A checkpoint refused for a non-finite weight: train on from the newest checkpoint's weights.

        The steps since it are dropped with the weights they changed (their transitions still
        count as trained, as in a rebase); AdamW's moments come back with it, or start afresh
        where it was written without them. With no checkpoint yet there is nothing good to go
        back to: the error is raised and the worker stops.
        """
        self.summary.refused_checkpoints += 1
        log.error("trainer %s: checkpoint v%d not written: %s", self.name, version, error)
        manifest = latest_manifest(self.store, self.name)
        if manifest is None:
            raise NonFiniteWeights(f"trainer {self.name}: {error}, and there is no checkpoint to go back to: "
                                   "stopping") from None
        folder = await asyncio.to_thread(self.store.get, manifest.uri)
        await self._on_model_thread(restore_last_good, self.policy, folder)
        await self._sync()
        self.progress(f"trainer {self.name}: v{version} refused (a weight is not finite); training on from "
                      f"v{manifest.version}'s weights (step {manifest.step})")

    async def _write(self, write: Callable[[], Written], staging: Path, version: int, step: int,
                     positions: dict[TopicPartition, int], trained_ids: list[str], metrics: dict[str, float]) -> None:
        offsets = {f"{tp.topic}:{tp.partition}": offset for tp, offset in positions.items()}
        weights, sha256 = await asyncio.to_thread(write)
        manifest = await asyncio.to_thread(
            write_checkpoint, self.store, staging, weights, model=self.name, version=version, step=step,
            format=self.policy.format, offsets=offsets, trained_ids=trained_ids, metrics=metrics, sha256=sha256)
        await self._announce(manifest)
        self.tracker.checkpoint(manifest)
        self.resume_offsets = offsets
        self.summary.checkpoints += 1
        await self._commit(positions)
        await asyncio.to_thread(prune, self.store, self.name, self.settings.keep_checkpoints)
        self.progress(f"checkpoint v{manifest.version} (step {manifest.step}) sha256 {manifest.sha256[:12]} "
                      f"-> {manifest.uri}")

    async def _written(self) -> None:
        """Wait for the checkpoint in flight, if any (its failure is raised here)."""
        if self._writing is not None:
            try:
                await self._writing
            finally:
                self._writing = None

    async def _announce(self, manifest: Manifest) -> None:
        await self.announcer.announce(manifest)
        self._flush_metrics()
        await self._write_metrics(self.metrics.checkpoint if self.metrics else None, manifest)

    def _flush_metrics(self) -> None:
        """Write the buffered train_steps rows with one insert, in the background."""
        reports, self._reports, self._flushed_at = self._reports, [], time.monotonic()
        if reports and self.metrics is not None:
            task = asyncio.create_task(self._write_metrics(self.metrics.steps, reports))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _write_metrics(self, write: Callable | None, rows: object) -> None:
        """One ClickHouse write at a time; a failure is logged and does not stop training."""
        if write is None:
            return
        async with self._metrics_lock:
            await asyncio.to_thread(write_logged, write, rows)

    def _committable(self) -> dict[TopicPartition, int]:
        """Per partition: the oldest offset still queued for training, else the next offset to read."""
        positions = dict(self._consumed)
        for topic, partition, offset in self.batcher.pending_positions():
            tp = TopicPartition(topic, partition)
            if tp in positions:  # else read before a log reset: that position is gone
                positions[tp] = min(positions[tp], offset)
        return positions

    async def _commit(self, positions: dict[TopicPartition, int]) -> None:
        consumer = self.consumer
        assert consumer is not None  # only reached from run(), once the consumer has started
        changed = {tp: offset for tp, offset in positions.items()
                   if self._committed.get(tp) != offset and tp in consumer.assignment()}
        if not changed:
            return
        try:
            await consumer.commit(changed)
            self._committed.update(changed)
        except KafkaError as error:  # a rebalance in progress: the checkpoint's positions still protect a restart
            log.warning("offset commit failed (%s); will retry", error)

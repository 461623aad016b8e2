"""The `agentstream sft` process: supervised steps on the good rollouts of an exported dataset, then one checkpoint.

Rejection-sampling fine-tuning from a file of ``agentstream dataset export`` (``schemas/dataset.py``,
read row by row, so the file is never held in memory): a rollout whose final ``reward`` is at
least the threshold gives its ``samples`` (the trained transitions, with their loss masks), or,
where it has none (it was not trained on), one sample per LLM call; every other rollout is
counted and skipped. The samples train by the negative log-likelihood of their trained tokens
with the trainer's own batching and step (the ``supervised`` objective of ``trainer/batching.py``).
Training starts from the model's latest checkpoint, if any, and ends with the next version in the
same store, announced on the checkpoints topic like any other: hot swap loads it, and an RL
trainer started afterwards resumes from it (a warm start), at the Kafka positions the previous
checkpoint carried. It reports as the stream trainer does: a ``train_steps`` row per step and the
checkpoint's ``checkpoints`` row (``MetricsWriter``), and a run in the ``[tracking]`` trackers.
A file whose format or first row is wrong fails before the model is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from aiokafka.errors import KafkaError

from agentstream.infra.clickhouse import migrate, wait_for_clickhouse
from agentstream.infra.config import Config, TrainerConfig
from agentstream.infra.kafka import KafkaUnreachable
from agentstream.schemas.dataset import DatasetRow, read_rows
from agentstream.schemas.errors import AgentstreamError
from agentstream.trainer.batching import Batch, Batcher, Sample, SeenIds, TransitionError
from agentstream.trainer.checkpoint_writer import (
    CheckpointAnnouncer,
    Manifest,
    latest_manifest,
    open_store,
    write_checkpoint,
)
from agentstream.trainer.metrics import MetricsWriter, StepReport, write_logged
from agentstream.trainer.policy import Policy, build_policy, load_weights, save_weights_later
from agentstream.trainer.step import train_step
from agentstream.trainer.tracking import Tracker

log = logging.getLogger("agentstream.trainer")


class NothingToTrain(AgentstreamError, ValueError):
    """A dataset with no sample to train: no rollout reached the reward threshold (or none had a usable sample)."""

    retriable = False


@dataclass
class SftSummary:
    """What a run of ``run_sft`` did: per pass over the file, the rollouts and samples read; in all, the steps."""

    rollouts: int = 0
    unrewarded: int = 0  # rollouts without a final reward: never kept
    invalid: int = 0  # rollouts whose token ids or loss masks do not fit together (logged)
    samples: int = 0
    below_threshold: int = 0  # samples of rollouts whose reward is below the threshold
    trained: int = 0  # samples trained, over all passes
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    manifest: Manifest | None = None


def row_samples(row: DatasetRow) -> list[Sample]:
    """A rollout's samples as the trainer takes them: its ``samples``, else one per call; rewarded with its reward.

    They carry no behaviour logprobs and advantage 1, as ``agentstream.trainer.batching.supervised`` makes
    them: a likelihood step ignores both.
    """
    reward = row["reward"]
    records = [dict(sample, behaviour_logprobs=[]) for sample in row["samples"]] or [
        {"transition_id": f"{row['rollout_id']}/{call['span_id']}", "policy_version": call["policy_version"] or 0,
         "prompt_token_ids": call["prompt_token_ids"], "response_token_ids": call["response_token_ids"],
         "behaviour_logprobs": [], "loss_mask": []} for call in row["calls"]]
    return [Sample.from_record({**record, "rollout_id": row["rollout_id"], "reward": reward, "advantage": 1.0})
            for record in records]


def check_vocabulary(samples: list[Sample], vocabulary: int) -> None:
    """TransitionError where a sample holds a token id the model has no embedding for (another tokenizer's
    dataset, a corrupted file): torch would stop the whole run on it with an IndexError."""
    for sample in samples:
        outside = next((i for i in (*sample.prompt_ids, *sample.response_ids) if i >= vocabulary), None)
        if outside is not None:
            raise TransitionError(f"transition {sample.transition_id} has token id {outside}, outside the model's "
                                  f"vocabulary of {vocabulary}")


def vocabulary_size(policy: Policy) -> int | None:
    """How many token ids the model's input embedding has rows for (None where the model does not say)."""
    getter = getattr(policy.model, "get_input_embeddings", None)
    size = getattr(getter() if callable(getter) else None, "num_embeddings", None)
    return size if isinstance(size, int) else None


def dataset_samples(path: Path, summary: SftSummary, vocabulary: int | None = None) -> Iterator[Sample]:
    """The samples of every rewarded rollout of the file, in file order (selection by reward is the batcher's);
    a rollout with a token id outside ``vocabulary`` (when given) is invalid, counted and skipped."""
    for row in read_rows(path):
        summary.rollouts += 1
        if row["reward"] is None:
            summary.unrewarded += 1
            continue
        try:
            samples = row_samples(row)
            if vocabulary is not None:
                check_vocabulary(samples, vocabulary)
        except TransitionError as error:
            summary.invalid += 1
            log.warning("skipped rollout %s of %s: %s", row["rollout_id"], path, error)
            continue
        yield from samples


def first_row(dataset: Path) -> DatasetRow:
    """The file's first row, checked: a wrong format or row fails here, before a model is loaded for it."""
    for row in read_rows(dataset):
        return row
    raise NothingToTrain(f"{dataset}: no rollouts: no checkpoint written")


class SupervisedSteps:
    """Takes the steps of one run and reports each as the stream trainer does: progress line, row, tracker."""

    def __init__(self, policy: Policy, settings: TrainerConfig, step: int, summary: SftSummary,
                 metrics: MetricsWriter | None, tracker: Tracker, progress: Callable[[str], None]) -> None:
        self.policy, self.settings, self.step, self.summary = policy, settings, step, summary
        self.metrics, self.tracker, self.progress = metrics, tracker, progress
        self.last: StepReport | None = None
        self.below_threshold = 0  # samples below the threshold behind the steps taken, over all passes

    def take(self, batch: Batch | None) -> None:
        """One supervised step on ``batch`` (none: nothing fresh was queued)."""
        if batch is None:
            return
        self.below_threshold += batch.counts.below_threshold
        result = train_step(self.policy, batch, self.settings)
        if result.skipped:
            self.progress(f"step skipped: loss {result.loss} |g| {result.grad_norm} not finite")
            return
        self.step += 1
        self.summary.steps += 1
        self.summary.tokens += result.tokens
        self.summary.trained += result.transitions
        report = self.last = StepReport.of(self.policy.name, self.step, batch, result)
        self.progress(report.line())
        if self.metrics is not None:  # one insert per step: a step takes seconds, the insert milliseconds
            write_logged(self.metrics.steps, [report])
        self.tracker.step(report)


def run_sft(config: Config, bootstrap_servers: str, dataset: Path, *, epochs: int = 1,
            progress: Callable[[str], None] = print, policy: Policy | None = None,
            metrics: MetricsWriter | None = None) -> SftSummary:
    """Train ``config.trainer.model`` on the dataset's good rollouts for ``epochs`` passes; write and announce it.

    The threshold is ``trainer.supervised_min_reward``; batches close as the stream trainer's do
    (``batch_transitions``, ``batch_tokens``). With ``metrics``, each step and the checkpoint are
    ClickHouse rows; ``[tracking]`` gets the run.
    """
    settings = replace(config.trainer, objective="supervised")
    first_row(dataset)
    tracker = Tracker(config.tracking)  # a tracker configured but not installed fails here, before the model
    _reach(config, bootstrap_servers, "nothing was trained")
    policy = policy or build_policy(settings)
    checkpoint_dir = settings.checkpoint_dir or str(config.stack.home / "checkpoints")
    store = open_store(checkpoint_dir, config.checkpoints, config.stack.home)
    start = latest_manifest(store, policy.name)
    if start is not None:
        load_weights(policy, store.get(start.uri))
        progress(f"sft {policy.name}: from version {start.version} (step {start.step}) at {start.uri}")
    else:
        progress(f"sft {policy.name}: no checkpoint yet, from {settings.model} at version 0")
    version = start.version if start is not None else 0
    summary = SftSummary()
    steps = SupervisedSteps(policy, settings, start.step if start is not None else 0, summary, metrics, tracker,
                            progress)
    if tracking := tracker.start(settings, policy.name, version, checkpoint_dir):
        progress(tracking)
    started = time.monotonic()
    try:
        # one batcher for every pass, so a pass's last samples open the next pass's first step instead of a step
        # of their own; a later pass's copy of a sample gets an id of its own, or the batcher would drop it as seen
        batcher = Batcher(batch_tokens=settings.batch_tokens, batch_transitions=settings.batch_transitions,
                          batch_wait_s=0, max_policy_lag=settings.max_policy_lag, skip_zero_advantage=False,
                          seen=SeenIds(settings.dedupe_window), min_reward=settings.supervised_min_reward)
        for epoch in range(1, epochs + 1):
            summary.rollouts = summary.unrewarded = summary.invalid = summary.samples = 0
            below_before = steps.below_threshold + batcher.counts.below_threshold
            for sample in dataset_samples(dataset, summary, vocabulary_size(policy)):
                summary.samples += 1
                copy = sample if epoch == 1 else replace(sample, transition_id=f"{sample.transition_id}#{epoch}")
                batcher.offer(copy, version, 0.0)
                while batcher.ready(0.0):
                    steps.take(batcher.take(version))
            summary.below_threshold = steps.below_threshold + batcher.counts.below_threshold - below_before
            progress(f"sft epoch {epoch}/{epochs}: {summary.rollouts} rollouts ({summary.unrewarded} without a "
                     f"reward, {summary.invalid} invalid), {summary.samples} samples, {summary.below_threshold} "
                     f"below reward {settings.supervised_min_reward:g}; {summary.steps} steps so far")
        while len(batcher):
            steps.take(batcher.take(version))
        summary.seconds = time.monotonic() - started
        if steps.last is None:
            raise NothingToTrain(f"{dataset}: no sample of a rollout with reward >= "
                                 f"{settings.supervised_min_reward:g} ({summary.rollouts} rollouts, "
                                 f"{summary.below_threshold} samples below it): no checkpoint written")
        staging = store.staging()
        weights, sha256 = save_weights_later(policy, staging, settings.optimizer_state_every > 0)()
        # the transitions trained here may still be trained by the RL trainer (another objective), so none are listed
        summary.manifest = write_checkpoint(
            store, staging, weights, model=policy.name, version=version + 1, step=steps.step, format=policy.format,
            offsets=dict(start.offsets) if start else {}, trained_ids=[],
            metrics={**steps.last.checkpoint_metrics(), "supervised_steps": float(summary.steps)}, sha256=sha256)
        _reach(config, bootstrap_servers, f"checkpoint v{summary.manifest.version} is written at "
               f"{summary.manifest.uri} but not announced: hot swap and train-worker will not see it until a later "
               f"checkpoint is announced", summary.manifest)
        if metrics is not None:
            write_logged(metrics.checkpoint, summary.manifest)
        tracker.checkpoint(summary.manifest)
        progress(f"checkpoint v{summary.manifest.version} (step {steps.step}) sha256 "
                 f"{summary.manifest.sha256[:12]} -> {summary.manifest.uri}")
    finally:
        tracker.finish()
        if tracking := tracker.summary():
            progress(tracking)
    return summary


def run_supervised(config: Config, bootstrap_servers: str, clickhouse_url: str, dataset: Path, *, epochs: int = 1,
                   progress: Callable[[str], None] = print) -> SftSummary:
    """``agentstream sft``: ``run_sft`` with its rows written to ClickHouse (the dashboard, ``report`` and the gate
    read them); the file's first row is checked before ClickHouse is waited for."""
    first_row(dataset)
    database = config.clickhouse.database
    client = wait_for_clickhouse(config.clickhouse, clickhouse_url, timeout_s=30)
    try:
        migrate(client, database)
        return run_sft(config, bootstrap_servers, dataset, epochs=epochs, progress=progress,
                       metrics=MetricsWriter(client, database))
    finally:
        client.close()


def _reach(config: Config, bootstrap_servers: str, consequence: str, manifest: Manifest | None = None) -> None:
    """Announce ``manifest`` on the checkpoints topic (None: only connect, to fail before training, not after);
    KafkaUnreachable, retriable, saying ``consequence``, when the broker cannot take it."""
    try:
        asyncio.run(_announce(config, bootstrap_servers, manifest))
    except KafkaError as error:
        raise KafkaUnreachable(f"the Kafka broker at {bootstrap_servers} cannot be reached ({error}): "
                               f"{consequence}") from None


async def _announce(config: Config, bootstrap_servers: str, manifest: Manifest | None) -> None:
    announcer = CheckpointAnnouncer(config, bootstrap_servers)
    try:
        await announcer.start()
        if manifest is not None:
            await announcer.announce(manifest)
    finally:
        await announcer.stop()

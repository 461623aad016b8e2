"""Per-step training metrics: one ClickHouse ``train_steps`` row, one readable progress line, checkpoint rows."""

from __future__ import annotations

import datetime
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from agentstream.schemas.checkpoint import CHECKPOINT_COLUMNS
from agentstream.trainer.batching import Batch
from agentstream.trainer.checkpoint_writer import Manifest
from agentstream.trainer.step import StepResult

log = logging.getLogger("agentstream.trainer")
Rows = TypeVar("Rows")

TRAIN_STEP_COLUMNS = (
    "model", "step", "policy_version", "loss", "reward_mean", "advantage_mean", "advantage_std", "kl", "entropy",
    "clip_fraction", "importance_weight_mean", "staleness_mean", "staleness_max", "dropped_stale", "transitions",
    "tokens", "tokens_per_s", "step_time_s", "created_at", "skipped_nonfinite", "calls_per_sample", "prefix_breaks",
)


@dataclass(frozen=True)
class StepReport:
    """Everything reported about one optimizer step (the train_steps columns plus a few for the progress line)."""

    model: str
    step: int
    policy_version: int
    loss: float
    reward_mean: float
    advantage_mean: float
    advantage_std: float
    kl: float
    entropy: float
    clip_fraction: float
    importance_weight_mean: float
    staleness_mean: float
    staleness_max: int
    dropped_stale: int
    transitions: int
    tokens: int
    tokens_per_s: float
    step_time_s: float
    created_at: datetime.datetime
    duplicates: int
    uninformative: int
    invalid: int
    truncated_fraction: float
    grad_norm: float
    skipped_nonfinite: int = 0
    """Batches skipped since the previous step because their loss or gradient norm was not finite."""
    calls_per_sample: float = 1.0
    """The mean number of LLM calls merged into each sample (1 at transition level)."""
    prefix_breaks: int = 0
    """Samples of this step that start where their rollout's token prefix broke (trajectory level)."""
    below_threshold: int = 0
    """Supervised objective: transitions behind this step not trained, their rollout's reward below the threshold."""

    @classmethod
    def of(cls, model: str, step: int, batch: Batch, result: StepResult, skipped_nonfinite: int = 0) -> StepReport:
        stats, lags = result.stats, batch.lags()
        advantage_mean, advantage_std = batch.advantage_stats()
        return cls(
            model=model, step=step, policy_version=batch.current_version, loss=result.loss,
            reward_mean=statistics.fmean(batch.rewards()), advantage_mean=advantage_mean,
            advantage_std=advantage_std, kl=stats.mean("kl"), entropy=stats.mean("entropy"),
            clip_fraction=stats.mean("clipped"), importance_weight_mean=stats.mean("importance_weight"),
            staleness_mean=statistics.fmean(lags) if lags else 0.0, staleness_max=max(lags, default=0),
            dropped_stale=batch.counts.stale,
            transitions=result.transitions, tokens=result.tokens, tokens_per_s=result.tokens_per_s,
            step_time_s=result.seconds, created_at=datetime.datetime.now(datetime.UTC),
            duplicates=batch.counts.duplicate, uninformative=batch.counts.uninformative, invalid=batch.counts.invalid,
            truncated_fraction=stats.mean("truncated"), grad_norm=result.grad_norm, skipped_nonfinite=skipped_nonfinite,
            calls_per_sample=batch.calls_per_sample, prefix_breaks=batch.prefix_breaks,
            below_threshold=batch.counts.below_threshold,
        )

    def row(self) -> tuple:
        return tuple(getattr(self, column) for column in TRAIN_STEP_COLUMNS)

    def line(self) -> str:
        return (f"step {self.step:>5} v{self.policy_version:<4} loss {self.loss:+.4f}  reward {self.reward_mean:.3f}  "
                f"adv {self.advantage_mean:+.2f}±{self.advantage_std:.2f}  kl {self.kl:.4f}  ent {self.entropy:.2f}  "
                f"clip {self.clip_fraction:.3f}  w {self.importance_weight_mean:.3f}  |g| {self.grad_norm:.2f}  "
                f"lag {self.staleness_mean:.1f}/{self.staleness_max}  dropped stale {self.dropped_stale} "
                f"dup {self.duplicates} flat {self.uninformative} bad {self.invalid} "
                f"{f'nonfinite {self.skipped_nonfinite} ' if self.skipped_nonfinite else ''} "
                f"{f'below threshold {self.below_threshold} ' if self.below_threshold else ''}"
                f"{self._trajectory()}{self.transitions} tr {self.tokens} tok {self.tokens_per_s:,.0f} tok/s "
                f"{self.step_time_s:.2f}s")

    def _trajectory(self) -> str:
        """Calls per sample and prefix breaks, where samples merge calls (nothing at transition level)."""
        if self.calls_per_sample == 1 and not self.prefix_breaks:
            return ""
        return f"calls/sample {self.calls_per_sample:.2f} breaks {self.prefix_breaks} "

    def checkpoint_metrics(self) -> dict[str, float]:
        """The numbers carried by the Checkpoint event and the checkpoints row."""
        return {"loss": self.loss, "reward_mean": self.reward_mean, "kl": self.kl, "entropy": self.entropy,
                "clip_fraction": self.clip_fraction, "staleness_mean": self.staleness_mean}


class MetricsWriter:
    """Writes train_steps and checkpoints rows to ClickHouse (idempotent: both tables replace by key)."""

    def __init__(self, client, database: str) -> None:
        self.client = client
        self.database = database

    def steps(self, reports: list[StepReport]) -> None:
        if reports:
            self.client.insert(f"{self.database}.train_steps", [r.row() for r in reports],
                               column_names=list(TRAIN_STEP_COLUMNS))

    def checkpoint(self, manifest: Manifest) -> None:
        self.client.insert(f"{self.database}.checkpoints", [manifest.checkpoint().row()],
                           column_names=list(CHECKPOINT_COLUMNS))


def write_logged(write: Callable[[Rows], None], rows: Rows) -> None:
    """Write ``rows`` with a MetricsWriter method; a failure is logged, not raised: metrics never stop training."""
    try:
        write(rows)
    except Exception as error:  # clickhouse-connect raises several types for "unreachable" or "refused"
        log.error("could not write trainer metrics to ClickHouse: %s", error)

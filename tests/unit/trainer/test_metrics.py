"""The train_steps row and line: calls per sample and prefix breaks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.samples import record
from trainer.batching import Batch, Counts, Sample
from trainer.loss import TokenStats
from trainer.metrics import TRAIN_STEP_COLUMNS, StepReport
from trainer.step import StepResult


def test_the_train_steps_row_counts_calls_per_sample_and_prefix_breaks():
    merged = Sample.from_record(record())
    samples = [merged, replace(merged, transition_id="b", merged_calls=3, split_at_break=False),
               Sample.from_record(record(transition_id="c", loss_mask=[], merged_calls=1, split_at_break=False))]
    result = StepResult(TokenStats(tokens=21), 0.1, 1.0, 3, 48, 0.5)
    report = StepReport.of("m", 1, Batch(samples, 0, Counts()), result)
    row = dict(zip(TRAIN_STEP_COLUMNS, report.row(), strict=True))
    assert row["calls_per_sample"] == pytest.approx(2.0) and row["prefix_breaks"] == 1
    assert "calls/sample 2.00 breaks 1" in report.line()
    plain = StepReport.of("m", 2, Batch([samples[2]], 0, Counts()), result)
    assert (plain.calls_per_sample, plain.prefix_breaks) == (1.0, 0) and "calls/sample" not in plain.line()

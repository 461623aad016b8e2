"""The train_steps row and line: calls per sample and prefix breaks."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from agentstream.trainer.batching import Batch, Counts, Sample
from agentstream.trainer.loss import TokenStats
from agentstream.trainer.metrics import TRAIN_STEP_COLUMNS, StepReport, write_logged
from agentstream.trainer.step import StepResult
from tests.support.samples import record


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


def test_a_metrics_write_that_fails_is_logged_not_raised(caplog):
    written: list[list[int]] = []
    write_logged(written.append, [1])

    def refused(rows: list[int]) -> None:
        raise ConnectionRefusedError(111, "Connection refused")

    with caplog.at_level(logging.ERROR, logger="agentstream.trainer"):
        write_logged(refused, [2])
    assert written == [[1]]
    assert "could not write trainer metrics to ClickHouse: [Errno 111] Connection refused" in caplog.text

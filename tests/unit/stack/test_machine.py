"""The machine calibration and the per-process CPU counters the benches report costs with."""

from __future__ import annotations

import os
import time

from agentstream.stack.machine import calibrate, cpu_model, process_cpu_seconds


def test_process_cpu_seconds_counts_this_process_work() -> None:
    before = process_cpu_seconds(os.getpid())
    assert before is not None
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    after = process_cpu_seconds(os.getpid())
    assert after is not None and 0.2 <= after - before <= 2.0


def test_calibration_names_the_machine_and_times_both_workloads() -> None:
    calibration = calibrate()
    assert calibration.cpu_model == cpu_model() and calibration.cpu_model
    assert 1 <= calibration.cores <= (os.cpu_count() or 1)
    assert 0.05 < calibration.python_loop_s < 30
    assert 0.001 < calibration.numpy_matmul_s < 30
    assert set(calibration.as_dict()) == {"cpu_model", "cores", "python_loop_s", "numpy_matmul_s"}


def test_wilson_interval_brackets_the_rate_and_narrows_with_more_tasks() -> None:
    from tests.support.intervals import wilson_interval

    low, high = wilson_interval(0.75, 64)
    assert low < 0.75 < high and low > 0.6 and high < 0.86
    narrow = wilson_interval(0.75, 640)
    assert narrow[1] - narrow[0] < (high - low) / 2
    assert wilson_interval(1.0, 64)[1] == 1.0 and wilson_interval(0.0, 64)[0] == 0.0

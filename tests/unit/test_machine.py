"""The machine calibration and the per-process CPU counters the benches report costs with."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from infra.machine import calibrate, cpu_model, process_cpu_seconds


def test_process_cpu_seconds_counts_this_process_work() -> None:
    before = process_cpu_seconds(os.getpid())
    assert before is not None
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    after = process_cpu_seconds(os.getpid())
    assert after is not None and 0.2 <= after - before <= 2.0


def test_process_cpu_seconds_of_another_process_and_of_one_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                                                    "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        seconds = process_cpu_seconds(child.pid)
        while (seconds or 0.0) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
            seconds = process_cpu_seconds(child.pid)
        assert seconds is not None and 0.5 <= seconds < 5
    finally:
        child.kill()
        child.wait()
    assert process_cpu_seconds(child.pid) is None


def test_calibration_names_the_machine_and_times_both_workloads() -> None:
    calibration = calibrate()
    assert calibration.cpu_model == cpu_model() and calibration.cpu_model
    assert 1 <= calibration.cores <= (os.cpu_count() or 1)
    assert 0.05 < calibration.python_loop_s < 30
    assert 0.001 < calibration.numpy_matmul_s < 30
    assert set(calibration.as_dict()) == {"cpu_model", "cores", "python_loop_s", "numpy_matmul_s"}

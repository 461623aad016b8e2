"""The machine calibration and the per-process CPU counters the benches report costs with."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from stack.machine import CpuShare, calibrate, child_processes, cpu_model, process_cpu_seconds, process_label


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


def test_child_processes_and_their_labels() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert sleeper.pid in child_processes(os.getpid())
        assert process_label(sleeper.pid) == Path(sys.executable).name
    finally:
        sleeper.kill()
        sleeper.wait()
    assert sleeper.pid not in child_processes(os.getpid())
    assert process_label(sleeper.pid) is None


def test_cpu_share_counts_a_busy_child_by_its_label() -> None:
    with CpuShare("me", cores=2, interval_s=0.2) as share:
        busy = subprocess.Popen([sys.executable, "-m", "timeit", "-n", "1", "-r", "1",
                                 "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"])
        busy.wait()
        time.sleep(0.1)
    seconds = share.seconds_by_label()
    assert 0.4 <= seconds.get("timeit", 0.0) <= 3.0, seconds
    shares = share.shares()
    assert list(shares) == sorted(shares, key=lambda label: -shares[label])
    assert 0 < shares["timeit"] <= 1.0


def test_cpu_share_counts_a_process_already_running_from_its_counter_at_the_start() -> None:
    busy = subprocess.Popen([sys.executable, "-m", "timeit", "-n", "1", "-r", "1",
                             "import time\nend = time.process_time() + 1.5\nwhile time.process_time() < end: pass"])
    try:
        deadline = time.monotonic() + 20
        while (process_cpu_seconds(busy.pid) or 0.0) < 0.8 and time.monotonic() < deadline:
            time.sleep(0.05)
        with CpuShare("me", cores=2, interval_s=0.2) as share:
            busy.wait()
    finally:
        busy.kill()
        busy.wait()
    assert share.seconds_by_label().get("timeit", 0.0) < 1.0, share.seconds_by_label()  # not its ~0.8 s before


def test_wilson_interval_brackets_the_rate_and_narrows_with_more_tasks() -> None:
    from bench.learning import wilson_interval

    low, high = wilson_interval(0.75, 64)
    assert low < 0.75 < high and low > 0.6 and high < 0.86
    narrow = wilson_interval(0.75, 640)
    assert narrow[1] - narrow[0] < (high - low) / 2
    assert wilson_interval(1.0, 64)[1] == 1.0 and wilson_interval(0.0, 64)[0] == 0.0

"""Other processes as the benches and the consumer groups see them: CPU seconds and shares of child
processes (stack/machine.py) and a group member whose process is gone (infra/members.py).

These start child processes, so they live here and not in tests/unit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from agentstream.infra.members import MemberLedger
from agentstream.stack.kafka import MAIN_CLASS
from agentstream.stack.machine import CpuShare, child_processes, process_cpu_seconds, process_label


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


def test_apache_kafkas_jvm_is_labelled_broker_like_tansu() -> None:
    """The JVM is told by its main class (bench.streams counts the broker's CPU by this label)."""
    jvm_like = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", MAIN_CLASS, "server.properties"])
    try:
        deadline = time.monotonic() + 10
        while MAIN_CLASS.encode() not in Path(f"/proc/{jvm_like.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.02)  # until the child has exec'd its command line
        assert process_label(jvm_like.pid) == "broker"
    finally:
        jvm_like.kill()
        jvm_like.wait()


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


def test_a_member_whose_process_is_gone_is_dead_and_a_live_one_is_not(tmp_path):
    ledger = MemberLedger(tmp_path, "agentstream-streams")
    gone = subprocess.Popen(["true"])
    gone.wait()
    ledger.record("mine-1")
    ledger.record("mine-2")  # a rejoin: this process's earlier id is dropped
    members = ledger._read()
    members["theirs"] = {"pid": gone.pid, "ticks": 1}
    ledger._write(members)
    assert ledger.dead() == ["theirs"]
    assert set(ledger._read()) == {"mine-2", "theirs"}
    assert ledger._read()["mine-2"]["pid"] == os.getpid()
    ledger.forget(["theirs"])
    assert ledger.dead() == [] and set(ledger._read()) == {"mine-2"}

"""What the machine is and what a process costs on it, so figures taken on different machines can be compared.

Benchmarks and the demo print one calibration line beside their figures: the CPU model, the
cores this process may use, and the seconds a fixed pure-Python loop and a fixed numpy workload
take here. Two machines whose figures disagree by 2-3x usually disagree by as much on these.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from agentstream.stack.kafka import MAIN_CLASS

PYTHON_LOOP_ITERATIONS = 10_000_000
NUMPY_MATMUL_SIZE = 512
NUMPY_MATMUL_REPEATS = 40
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Calibration:
    """One machine's reference times (seconds; lower is faster)."""

    cpu_model: str
    cores: int
    python_loop_s: float
    """``PYTHON_LOOP_ITERATIONS`` iterations of an integer-summing for loop, one thread."""
    numpy_matmul_s: float
    """``NUMPY_MATMUL_REPEATS`` float64 matmuls of ``NUMPY_MATMUL_SIZE`` squared, numpy's own threads."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        """``<cpu model>, 2 cores; calibration: a fixed Python loop 0.25 s, numpy 0.40 s``, for start-up lines."""
        return (f"{self.cpu_model}, {self.cores} cores; calibration: a fixed Python loop {self.python_loop_s:.2f} s, "
                f"numpy {self.numpy_matmul_s:.2f} s")


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (platform's guess where /proc/cpuinfo has none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate() -> Calibration:
    """Time the two fixed workloads (about 1-2 s in all on a 2-core cloud machine)."""
    import numpy

    began = time.perf_counter()
    total = 0
    for number in range(PYTHON_LOOP_ITERATIONS):
        total += number
    python_loop_s = time.perf_counter() - began

    rng = numpy.random.default_rng(0)
    matrix = rng.random((NUMPY_MATMUL_SIZE, NUMPY_MATMUL_SIZE))
    began = time.perf_counter()
    for _ in range(NUMPY_MATMUL_REPEATS):
        matrix = matrix @ matrix
        matrix /= numpy.abs(matrix).max()
    numpy_matmul_s = time.perf_counter() - began
    return Calibration(cpu_model=cpu_model(), cores=len(os.sched_getaffinity(0)),
                       python_loop_s=round(python_loop_s, 3), numpy_matmul_s=round(numpy_matmul_s, 3))


def resident_mb(pid: int) -> float:
    """A process's resident memory (VmRSS) in MB; 0 where /proc does not say."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds a live process has used so far (its own threads, not its children); None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime and stime, fields 14 and 15 of proc(5)


def child_processes(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, their children, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def process_label(pid: int) -> str | None:
    """A short name for one of the project's processes: ``agentstream serve-model``, ``broker``, ``clickhouse``, ..."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        argv = [part.decode(errors="replace") for part in raw.split(b"\0") if part]
    except OSError:
        return None
    if not argv:
        return None
    for module, label in (("agentstream.stack.chserver", "clickhouse"),
                          ("agentstream.stack.objectstore", "objectstore"),
                          ("agentstream.stack.registry_server", "schema-registry")):
        if module in argv:
            return label
    if Path(argv[0]).name == "tansu" or MAIN_CLASS in argv:  # tansu, or Apache Kafka's JVM
        return "broker"
    if "agentstream" in argv:
        rest = argv[argv.index("agentstream") + 1:]
        return f"agentstream {rest[0]}" if rest else "agentstream"
    if len(argv) > 2 and argv[1] == "-m":
        return argv[2]
    return Path(argv[0]).name


class CpuShare(threading.Thread):
    """Each process's share of the machine while a block runs: this process and every descendant, by label.

    CPU counters are read every ``interval_s``; a process that exits between two readings keeps what
    was last read of it, so short-lived processes are undercounted by at most one interval. A process
    already running at the start counts from its counter then; one started later counts all its CPU.
    """

    def __init__(self, label: str, cores: int, interval_s: float = 2.0) -> None:
        super().__init__(name="cpu-share", daemon=True)
        self.label, self.cores, self.interval_s = label, cores, interval_s
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.began = self.ended = 0.0
        self.stopping = threading.Event()

    def __enter__(self) -> CpuShare:
        self.began = time.monotonic()
        self._read(baseline=True)
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.join()
        self._read()
        self.ended = time.monotonic()

    def run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self._read()

    def _read(self, baseline: bool = False) -> None:
        me = os.getpid()
        for pid in (me, *child_processes(me)):
            seconds = process_cpu_seconds(pid)
            label = self.label if pid == me else process_label(pid)
            if seconds is None or label is None:
                continue
            self.first.setdefault(pid, seconds if baseline else 0.0)
            self.last[pid] = (label, seconds)

    def seconds_by_label(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for pid, (label, seconds) in self.last.items():
            totals[label] += seconds - self.first[pid]
        return dict(totals)

    def shares(self) -> dict[str, float]:
        """CPU seconds per label over (wall seconds x cores), largest first; 1.0 is every core busy."""
        available = max(self.ended - self.began, 1e-9) * self.cores
        ordered = sorted(self.seconds_by_label().items(), key=lambda item: -item[1])
        return {label: round(seconds / available, 3) for label, seconds in ordered}

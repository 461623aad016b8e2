"""The whole loop for an hour at half the chaos load, a fault every few minutes: do memory and disk stay flat?

``make soak`` (``SOAK_MINUTES``, default 60) runs ``bench.chaos``'s harness: the private stack,
the model server, proxy, a stream worker, two trainers (one standing by), hot swap, two runners
and a direct publisher, at half of ``make chaos``'s load, with a SIGKILL or SIGSTOP of one
component from the chaos list every ``--min-gap``..``--max-gap`` seconds (3-5 minutes). Every
``--sample-s`` seconds it samples, per process, the resident memory and the open files (from
``/proc``), and the disk used by the broker's storage, ClickHouse, the checkpoint store and the
journals. The topics keep ten minutes of records and the trainer its 50 newest checkpoints, as
a long-running deployment would be set up, so those disks can level off.

The broker is one Apache Kafka node (``--broker tansu`` for the stack's default). tansu 0.6's
durable storage lists every batch a partition holds on each fetch and applies no retention, so it
slows as it fills: at this load the stream worker fell from 240 rollouts a minute to 23 within
25 minutes, with tansu at 118% CPU (docs/failure-model.md). An hour's soak measures the
pipeline, not that.

At the end, besides chaos's ledger (0 lost, 0 trained twice, 0 stuck), a Theil-Sen slope (the
median of the slopes between every two samples, which a passing spike does not tilt; the
least-squares slope is printed beside it) over the second half of each series, with its bound,
as JSON lines:

- memory, threads and open files per process: over the phase that lived longest in the second
  half, after its first ``warm-up`` (a fifth of the run, at most 5 minutes). A restart starts a
  new phase, and so does a standby trainer taking over: it then loads what it trains, a step
  that is not growth. Open files leave out the ``/proc`` handles a thread keeps of itself (chdb
  holds three per thread for its statistics), which the thread count measures instead;
- the broker's live heap when it is a JVM (Apache Kafka): each sample asks the JVM for a full
  collection (``jcmd GC.run``) and reads what it kept (``GC.heap_info``). A JVM's resident memory
  follows its heap towards ``-Xmx`` whatever it keeps alive, so its RSS is printed, not judged;
- disk of the checkpoints and the journals: the bytes themselves;
- disk of the broker and ClickHouse: bytes per acknowledged span (they keep what they are sent,
  so their bytes grow with the spans; what may not grow is the cost of each span).

A slope over its bound fails the run, as a ledger that does not balance does; the samples are
written to ``samples.jsonl`` in the work folder (kept with ``--keep`` or on failure).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agentstream.infra.processes import ServiceDirectory
from agentstream.stack.control import BROKER, CLICKHOUSE, OBJECTSTORE
from bench import chaos
from bench.common import emit, slope_per_hour
from bench.streams import rss_mb

BENCH = "soak"
WARMUP_MAX_S = 300.0
# growth per hour allowed over the second half: max(absolute, relative x the series' mean)
BOUNDS = {"rss_mb": (8.0, 0.05), "live_heap_mb": (8.0, 0.05), "threads": (4.0, 0.05), "open_files": (4.0, 0.05),
          "disk_mb": (8.0, 0.05), "disk_bytes_per_span": (0.0, 0.10)}
JVM_RSS = "a JVM's resident memory follows its heap towards -Xmx whatever it keeps alive; its live heap is judged"
HEAP_USED = re.compile(r"used (\d+)K")


@dataclass
class ProcessSample:
    pid: int
    rss_mb: float
    open_files: int  # descriptors, leaving out the /proc handles a thread keeps of itself
    threads: int
    role: str = ""  # a trainer's "active" or "standby"
    live_heap_mb: float | None = None  # a JVM's heap after a full collection


@dataclass
class Sample:
    at: float  # seconds since the load started
    processes: dict[str, ProcessSample] = field(default_factory=dict)
    disk_mb: dict[str, float] = field(default_factory=dict)
    spans: int = 0  # acknowledged so far


def process_sample(pid: int, role: str = "") -> ProcessSample | None:
    """The process's resident MB, open descriptors (not its threads' /proc handles) and threads; None when gone."""
    try:
        folder = f"/proc/{pid}/fd"
        names = os.listdir(folder)
        threads = len(os.listdir(f"/proc/{pid}/task"))
        memory = rss_mb(pid)
    except OSError:
        return None
    files = 0
    for name in names:
        try:
            files += not os.readlink(f"{folder}/{name}").startswith("/proc/")
        except OSError:
            pass  # closed meanwhile
    return ProcessSample(pid, round(memory, 1), files, threads, role)


def jvm_live_heap_mb(pid: int) -> float | None:
    """A JVM's heap after a full collection that ``jcmd`` (beside its java, in a JDK) asks it for; None when ``pid``
    is no JVM, its runtime has no jcmd, or the JVM does not answer."""
    try:
        java = Path(os.readlink(f"/proc/{pid}/exe"))
        jcmd = java.with_name("jcmd")
        if java.name != "java" or not jcmd.is_file():
            return None
        subprocess.run([str(jcmd), str(pid), "GC.run"], capture_output=True, timeout=30, check=True)
        info = subprocess.run([str(jcmd), str(pid), "GC.heap_info"], capture_output=True, text=True, timeout=30,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = HEAP_USED.search(info)
    return None if found is None else round(int(found.group(1)) / 1024, 1)


def disk_mb(folder: Path) -> float:
    """Bytes allocated under ``folder`` (files that vanish meanwhile are skipped), in MB."""
    allocated = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                allocated += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return allocated / 1e6


def sen_slope_per_hour(points: list[tuple[float, float]]) -> float:
    """The Theil-Sen slope (the median of the slopes between every two points), per hour.

    A count of descriptors that jumps for one sample while a reconnect holds a socket, or moves
    by one for good, tilts a least-squares fit over 20 samples past a bound of 4 an hour; the
    median of pairwise slopes does not move for a few such points, and a steady climb moves it
    as much as it moves the fit."""
    slopes = sorted((v2 - v1) / (t2 - t1) for i, (t1, v1) in enumerate(points) for t2, v2 in points[i + 1:]
                    if t2 > t1)
    if not slopes:
        return 0.0
    middle = len(slopes) // 2
    return (slopes[middle] if len(slopes) % 2 else (slopes[middle - 1] + slopes[middle]) / 2) * 3600


def longest_phase(samples: list[Sample], second: list[Sample], name: str,
                  warmup: float) -> list[tuple[float, ProcessSample]]:
    """``name``'s samples in ``second`` of its phase (pid and role) that lived longest there, after its warm-up.

    A phase starts at its first sample in the whole run: a restart is a new pid, a standby that takes
    over a new role, and each starts by loading what it serves."""
    born: dict[tuple[int, str], float] = {}
    for s in samples:
        if name in s.processes:
            born.setdefault((s.processes[name].pid, s.processes[name].role), s.at)
    lived: dict[tuple[int, str], int] = {}
    for s in second:
        if name in s.processes:
            phase = (s.processes[name].pid, s.processes[name].role)
            lived[phase] = lived.get(phase, 0) + 1
    longest = max(lived, key=lambda phase: lived[phase])
    return [(s.at, s.processes[name]) for s in second if name in s.processes
            and (s.processes[name].pid, s.processes[name].role) == longest and s.at >= born[longest] + warmup]


class SoakRun(chaos.ChaosRun):
    """The chaos harness, sampling memory, open files and disk every ``--sample-s`` while it watches."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        super().__init__(args, workdir)
        self.samples: list[Sample] = []
        self.began: float | None = None
        self.next_sample_at = 0.0
        self.sample_file = workdir / "samples.jsonl"

    def run_faults(self) -> None:
        self.began = time.time()
        self.sample()
        super().run_faults()

    def idle(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            if self.began is not None and time.time() >= self.next_sample_at:
                self.sample()
            left = end - time.monotonic()
            if left <= 0:
                return
            super().idle(min(left, max(0.05, self.next_sample_at - time.time())))

    def pids(self) -> dict[str, int]:
        found = {name: child.pid for name, child in self.children.items() if child.pid is not None}
        directory = ServiceDirectory(self.stack.home)
        for service in (BROKER, CLICKHOUSE, OBJECTSTORE):
            record = directory.record(service)
            if record is not None and record.alive():
                found[service] = record.pid
        return found

    def sample(self) -> None:
        assert self.began is not None
        now = time.time()
        sample = Sample(at=round(now - self.began, 1), spans=len(self.reader.state.spans))
        active = self.active_trainer()
        for name, pid in self.pids().items():
            trainer = name in self.children and self.children[name].kind == "trainer"
            role = ("active" if str(pid) == active else "standby") if trainer else ""
            if (found := process_sample(pid, role)) is not None:
                if name == BROKER and self.stopped != BROKER:  # a SIGSTOPped JVM answers jcmd only after SIGCONT,
                    found.live_heap_mb = jvm_live_heap_mb(pid)  # and the fault's SIGCONT waits for this sample
                sample.processes[name] = found
        folders = {"broker": self.stack.records_data, "clickhouse": self.stack.home / "clickhouse",
                   "checkpoints": self.checkpoints, "journals": self.work_home / "journal"}
        sample.disk_mb = {name: round(disk_mb(folder), 2) for name, folder in folders.items()}
        self.samples.append(sample)
        with open(self.sample_file, "a") as out:
            out.write(json.dumps(asdict(sample)) + "\n")
        self.next_sample_at = now + self.args.sample_s
        if len(self.samples) % max(1, round(300 / self.args.sample_s)) == 1:
            memory = ", ".join(f"{name} {found.rss_mb:.0f}" for name, found in sorted(sample.processes.items()))
            disk = ", ".join(f"{name} {mb:.0f}" for name, mb in sample.disk_mb.items())
            chaos.say(f"sample at {sample.at:.0f} s: RSS MB {memory}; disk MB {disk}")

    def finish(self) -> int:
        status = chaos.ChaosRun.finish(self)
        growing = self.flatness()
        return status or (1 if growing else 0)

    def flatness(self) -> list[str]:
        """The slope test over the second half of each series; the series over their bounds."""
        assert self.began is not None
        duration = self.args.seconds
        half = duration / 2
        second = [s for s in self.samples if half <= s.at <= duration]  # not the drain at the end
        warmup = min(WARMUP_MAX_S, duration / 5)
        jvms = {name for s in second for name, found in s.processes.items() if found.live_heap_mb is not None}
        series: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for name in sorted({name for s in second for name in s.processes}):
            kept = longest_phase(self.samples, second, name, warmup)
            for measure in ("rss_mb", "threads", "open_files", "live_heap_mb"):
                points = [(at, float(value)) for at, found in kept
                          if (value := getattr(found, measure)) is not None]
                if points or measure != "live_heap_mb":
                    series[(measure, name)] = points
        for name in ("checkpoints", "journals"):
            series[("disk_mb", name)] = [(s.at, s.disk_mb[name]) for s in second]
        for name in ("broker", "clickhouse"):
            series[("disk_bytes_per_span", name)] = [(s.at, s.disk_mb[name] * 1e6 / s.spans) for s in second if s.spans]
        growing = []
        for (measure, name), points in series.items():
            extra = {"soak_minutes": round(duration / 60, 1), "sample_s": self.args.sample_s}
            if len(points) < 5:
                emit(BENCH, f"{measure}_slope_per_h", None, "per h", series=name, samples=len(points),
                     note="fewer than 5 samples of one process after its warm-up: not tested", **extra)
                continue
            mean = sum(v for _, v in points) / len(points)
            absolute, relative = BOUNDS[measure]
            bound = max(absolute, relative * abs(mean))
            slope = sen_slope_per_hour(points)
            flat = slope <= bound
            judged = not (measure == "rss_mb" and name in jvms)
            if judged and not flat:
                growing.append(f"{measure} {name}")
            verdict = {"flat": flat} if judged else {"flat": flat, "judged": False, "note": JVM_RSS}
            emit(BENCH, f"{measure}_slope_per_h", round(slope, 3), "per h", series=name, bound=round(bound, 3),
                 least_squares=round(slope_per_hour(points), 3), mean=round(mean, 2), first=points[0][1],
                 last=points[-1][1], samples=len(points), **verdict, **extra)
        chaos.say("memory, open files and disk are flat over the second half" if not growing
                  else f"GROWING over the second half: {', '.join(growing)}")
        return growing


def main() -> None:
    parser = chaos.arguments()
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--sample-s", type=float, default=60.0, help="Seconds between two samples.")
    minutes = float(os.environ.get("SOAK_MINUTES", "60"))
    parser.set_defaults(seconds=minutes * 60, min_gap=180.0, max_gap=300.0, concurrency=2, tasks_per_s=1.5,
                        direct_rollouts_per_s=2.5, keep_checkpoints=50, retention_ms=600_000, broker="kafka")
    args = chaos.checked(parser)
    chaos.say(f"soak: {args.seconds / 60:.0f} minutes, a fault every {args.min_gap:.0f}-{args.max_gap:.0f} s, "
              f"a sample every {args.sample_s:.0f} s")
    raise SystemExit(chaos.run(args, SoakRun, prefix="agentstream-soak-"))


if __name__ == "__main__":
    main()

"""Stream workers joining and leaving their consumer group under load: stuck workers, lost spans, rebalance pauses.

A private stack on the chosen broker (Apache Kafka by default: its own group coordinator), spans and
transitions with ``--partitions`` partitions, two `agentstream streams` workers, and rollouts of 16 1 KB
spans published at ``--rate`` rollouts/s throughout. Every ``--change-every`` seconds the membership
changes, in the cycle: a worker joins, one leaves (SIGTERM, a LeaveGroup), one joins, one crashes
(SIGKILL: the coordinator waits out its session, or the next worker's eviction of it). Measured:

- stuck: at the end of each change's window (just before the next change), from the coordinator's own
  view (DescribeGroups and the committed offsets, polled every ``POLL_S``): spans partitions assigned to
  nobody (``unassigned`` is null where the coordinator reports no member's assignment: tansu 0.6), spans
  partitions whose committed offset did not move over the window's last ``PROGRESS_S`` seconds
  (``stalled``), members beyond the live workers (a dead worker still in the group), live workers beyond
  the members (a worker outside the group), and members whose every partition stalled;
- lost: spans published (and acknowledged) but not in ClickHouse after the load stops and the workers
  drain, and rollouts without transitions in ClickHouse;
- pause: per change, from the change (the signal, or a joining worker's process start) until spans
  flow again on every partition: for each spans partition, the longest time, from the change or any
  later advance in its window, until the group's committed offset there next advanced (the workers
  commit every 0.5 s what they have processed; polled every ``POLL_S``); the change's pause is its
  slowest partition's. A partition whose member crashed waits for the coordinator to notice (the
  session timeout) while the others flow, which a whole-table measure would hide. A steady window's
  own figure (``steady_gap_s``, the same over the ``STEADY_S`` seconds before each change) is printed
  beside it, and ``clickhouse_gap_s``: the same measure over the moments inserts of spans landed in
  ClickHouse (the distinct ``ingested_at``; a batch stored again after a crash keeps only its later
  time, which can lengthen that gap, never shorten it);
- rebalances: how often the coordinator's stable assignment changed (members or their partitions).

Prints JSON lines (a calibration line first, every line names its broker); exit 1 if anything was stuck
or lost. The workers' logs are kept in ``bench-output/rebalance-<broker>/``. ``make bench-rebalance`` runs
``--minutes 20 --broker kafka``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from aiokafka import AIOKafkaConsumer, TopicPartition

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import BROKERS, Config
from agentstream.infra.kafka import admin_client, client_options, topic_name, topic_partitions
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.stack.machine import calibrate
from bench.common import cli_environ, emit, private_stack
from bench.streams import SPANS_PER_ROLLOUT, Workload, start_worker, wait_ready

BENCH = "rebalance"
POLL_S = 0.25
PROGRESS_S = 15.0
STEADY_S = 20.0
CHANGES = ("join", "leave", "join", "crash")


@dataclass(frozen=True)
class GroupView:
    """One look at the group from its coordinator: state, each member's spans partitions, committed offsets."""

    at: float
    state: str
    members: dict[str, tuple[int, ...]]
    committed: dict[int, int]


@dataclass
class Change:
    """One membership change and what its window showed (filled in at the window's end and after the run)."""

    number: int
    kind: str
    at: float
    workers_after: int
    ends: float = 0.0
    unassigned: list[int] | None = field(default_factory=list)
    """Spans partitions no member holds; None where the coordinator reports no member's assignment (tansu 0.6)."""
    stalled: list[int] = field(default_factory=list)
    ghosts: int = 0
    missing_workers: int = 0
    idle_members: int = 0
    state: str = ""

    @property
    def stuck(self) -> int:
        """Partitions unassigned or not advancing, members beyond the live workers or short of them, idle members."""
        partitions = set(self.unassigned or ()) | set(self.stalled)
        return len(partitions) + self.ghosts + self.missing_workers + self.idle_members


class Load(threading.Thread):
    """Rollouts of 16 spans through one SpanPublisher at a steady rate until stopped; counts what it published."""

    def __init__(self, config: Config, bootstrap: str, rate: float, journal: Path) -> None:
        super().__init__(name="load", daemon=True)
        self.config, self.bootstrap, self.rate, self.journal = config, bootstrap, rate, journal
        self.rollouts = 0
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        workload = Workload()
        try:
            with SpanPublisher(self.config, self.bootstrap, journal_dir=self.journal) as publisher:
                began = time.monotonic()
                while not self.stopping.is_set():
                    pause = began + self.rollouts / self.rate - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    workload.rollout(publisher)
                    self.rollouts += 1
                publisher.flush(120)
                stats = publisher.stats()
                if stats.spans_published != self.rollouts * SPANS_PER_ROLLOUT or stats.records_dropped:
                    raise RuntimeError(f"the publisher did not publish everything: {stats}")
        except BaseException as error:  # reported by the main thread, which owns the exit status
            self.error = error


class Watcher(threading.Thread):
    """Every ``POLL_S``: the group as its coordinator describes it."""

    def __init__(self, config: Config, bootstrap: str, group: str, spans_topic: str, partitions: int) -> None:
        super().__init__(name="watcher", daemon=True)
        self.config, self.bootstrap = config, bootstrap
        self.group, self.spans_topic = group, spans_topic
        self.partitions = [TopicPartition(spans_topic, partition) for partition in range(partitions)]
        self.views: list[GroupView] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        admin = admin_client(self.config, self.bootstrap)
        # The committed offsets come from a consumer of the group that never joins it (its partitions assigned by
        # hand and paused): tansu answers the admin client's OffsetFetch in a form aiokafka cannot decode.
        offsets = AIOKafkaConsumer(**client_options(self.config.kafka, self.bootstrap), group_id=self.group,
                                   enable_auto_commit=False)
        await admin.start()
        await offsets.start()
        offsets.assign(self.partitions)
        offsets.pause(*self.partitions)
        try:
            while not self.stopping.is_set():
                began = time.monotonic()
                self.views.append(await self._describe(admin, offsets))
                await asyncio.sleep(max(0.0, POLL_S - (time.monotonic() - began)))
        finally:
            await offsets.stop()
            await admin.close()

    async def _describe(self, admin, offsets: AIOKafkaConsumer) -> GroupView:
        """The group's state, members with their spans partitions (decoded from the consumer protocol's
        assignment bytes) and committed spans offsets."""
        from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

        at = time.time()
        [response] = await admin.describe_consumer_groups([self.group])
        described = response.groups[0]
        state, members = described[2], described[5]
        assigned: dict[str, tuple[int, ...]] = {}
        for member in members:
            raw = member[-1]
            partitions: tuple[int, ...] = ()
            if raw:
                decoded = ConsumerProtocolMemberAssignment.decode(raw)
                partitions = tuple(sorted(p for topic, ps in decoded.assignment if topic == self.spans_topic
                                          for p in ps))
            assigned[member[0]] = partitions
        committed = {tp.partition: await offsets.committed(tp) or -1 for tp in self.partitions}
        return GroupView(at, state, assigned, committed)


class Workers:
    """The streams worker processes of the run, each with its own log in ``folder``; stopped by PID only."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env, self.folder = env, folder
        self.live: list[tuple[subprocess.Popen, Path]] = []
        self.started = 0

    def join(self) -> float:
        """Start one worker; returns its start time, after waiting until it is ready."""
        log = self.folder / f"worker-{self.started}.log"
        self.started += 1
        started = time.time()
        process = start_worker(self.env, log)
        self.live.append((process, log))
        wait_ready(process, log)
        return started

    def leave(self, sig: signal.Signals) -> float:
        """Stop the oldest live worker with ``sig`` (SIGTERM: it leaves the group; SIGKILL: a crash); returns
        when the signal was sent, after the process is gone."""
        process, _log = self.live.pop(0)
        sent = time.time()
        process.send_signal(sig)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return sent

    def stop_all(self) -> None:
        while self.live:
            self.leave(signal.SIGTERM)


def judge_window(change: Change, views: list[GroupView], partitions: int, workers: Workers) -> None:
    """Fill in what was stuck at the end of ``change``'s window, from the coordinator's last views."""
    last = views[-1]
    earlier = [view for view in views if view.at <= last.at - PROGRESS_S]
    before = earlier[-1] if earlier and earlier[-1].at >= change.at else None
    owners = [p for assigned in last.members.values() for p in assigned]
    change.state = last.state
    change.unassigned = sorted(set(range(partitions)) - set(owners)) if owners or not last.members else None
    if before is not None:
        change.stalled = [p for p in range(partitions) if last.committed.get(p, -1) <= before.committed.get(p, -1)]
    live = len(workers.live)
    change.ghosts = max(0, len(last.members) - live)
    change.missing_workers = max(0, live - len(last.members))
    change.idle_members = sum(
        1 for assigned in last.members.values()
        if assigned and before is not None
        and all(last.committed.get(p, -1) <= before.committed.get(p, -1) for p in assigned))


def insert_times(client) -> list[float]:
    """When spans landed in ClickHouse: the distinct ``ingested_at`` of the spans table, in seconds, in order."""
    rows = client.query("SELECT DISTINCT toUnixTimestamp64Milli(ingested_at) AS at FROM spans ORDER BY at")
    return [row[0] / 1000 for row in rows.result_rows]


def rebalances(views: list[GroupView]) -> int:
    """How often the coordinator's stable assignment (members and their spans partitions) changed."""
    stable = [view.members for view in views if view.state == "Stable"]
    return sum(1 for before, after in itertools.pairwise(stable) if before != after)


def advances(views: list[GroupView], partition: int) -> list[float]:
    """When the group's committed offset of spans ``partition`` moved forward (as polled)."""
    return [after.at for before, after in itertools.pairwise(views)
            if after.committed.get(partition, -1) > before.committed.get(partition, -1)]


def partition_pause(change: Change, views: list[GroupView], partitions: int) -> float | None:
    """The change's slowest partition: the longest wait after ``change`` until its committed offset advanced;
    None when some partition never advanced again in the window."""
    waits = [pause_after(change, advances(views, partition)) for partition in range(partitions)]
    return None if any(wait is None for wait in waits) else max(w for w in waits if w is not None)


def partition_steady_gap(change: Change, views: list[GroupView], partitions: int) -> float | None:
    """The same as :func:`partition_pause`, over the ``STEADY_S`` seconds before ``change``."""
    gaps = [gap for gap in (steady_gap(change, advances(views, p)) for p in range(partitions)) if gap is not None]
    return max(gaps) if gaps else None


def pause_after(change: Change, moments: list[float]) -> float | None:
    """Seconds from ``change`` (or any later of ``moments`` before its window ends) until the next of ``moments``:
    the longest wait for progress in the change's window."""
    longest = None
    mark = change.at
    for rise in moments:
        if rise <= change.at:
            continue
        if mark >= change.ends:
            break
        longest = max(longest or 0.0, rise - mark)
        mark = rise
    return longest


def steady_gap(change: Change, moments: list[float]) -> float | None:
    """The longest time between two of ``moments`` in the ``STEADY_S`` seconds before ``change``."""
    steady = [at for at in moments if change.at - STEADY_S <= at <= change.at]
    gaps = [b - a for a, b in itertools.pairwise(steady)]
    return max(gaps) if gaps else None


def drain(client, published: int, rollouts: int, timeout_s: float) -> tuple[int, int, int]:
    """Wait until ClickHouse holds every published span and every rollout's transitions (or time runs out);
    returns (distinct spans stored, span rows stored, rollouts with transitions)."""
    deadline = time.monotonic() + timeout_s
    while True:
        distinct, rows = client.query("SELECT uniqExact(span_id), count() FROM spans").result_rows[0]
        trained = client.query("SELECT uniqExact(rollout_id) FROM transitions").result_rows[0][0]
        if (distinct >= published and trained >= rollouts) or time.monotonic() > deadline:
            return distinct, rows, trained
        time.sleep(1)


def say(message: str) -> None:
    print(f"rebalance: [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """One run on ``args.broker``; returns the exit status (1 when anything was stuck or lost)."""
    broker = args.broker
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", broker=broker, **calibration.as_dict())
    partitions = str(args.partitions)
    with (private_stack(AGENTSTREAM_BROKER=broker, AGENTSTREAM_TOPIC_PARTITIONS=partitions) as (config, endpoints),
          tempfile.TemporaryDirectory(prefix="agentstream-rebalance-") as scratch):
        spans_topic = topic_name(config.topics, "spans")
        layout = asyncio.run(_partitions(config, endpoints.bootstrap_servers,
                                         [spans_topic, topic_name(config.topics, "transitions")]))
        emit(BENCH, "topic_partitions", min(layout.values()), "partitions", broker=broker, topics=layout,
             session_timeout_s=config.streams.session_timeout_s)
        env = cli_environ(endpoints, scratch, AGENTSTREAM_TOPIC_PARTITIONS=partitions)
        logs = Path("bench-output") / f"rebalance-{broker}"
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True)
        workers = Workers(env, logs.resolve())
        client = connect(config.clickhouse, endpoints.clickhouse_url, database=config.clickhouse.database)
        watcher = Watcher(config, endpoints.bootstrap_servers, config.streams.app_id, spans_topic, args.partitions)
        load = Load(config, endpoints.bootstrap_servers, args.rate, Path(scratch) / "journal")
        changes: list[Change] = []
        try:
            for _ in range(2):
                workers.join()
            watcher.start()
            load.start()
            say(f"{broker}: 2 workers, {args.rate:g} rollouts/s; first change in {args.change_every:g} s")
            time.sleep(args.change_every)
            ends = time.monotonic() + args.minutes * 60
            while time.monotonic() < ends and load.error is None:
                kind = CHANGES[len(changes) % len(CHANGES)]
                if kind == "join":
                    at = workers.join()
                else:
                    at = workers.leave(signal.SIGTERM if kind == "leave" else signal.SIGKILL)
                change = Change(len(changes) + 1, kind, at, len(workers.live))
                changes.append(change)
                time.sleep(max(0.0, change.at + args.change_every - time.time()))
                change.ends = time.time()
                judge_window(change, watcher.views, args.partitions, workers)
                say(f"change {change.number} {kind}: {change.workers_after} workers, state {change.state}, "
                    f"stuck {change.stuck}")
            load.stopping.set()
            load.join()
            if load.error is not None:
                raise load.error
            published, rollouts = load.rollouts * SPANS_PER_ROLLOUT, load.rollouts
            distinct, rows, trained = drain(client, published, rollouts, args.drain_s)
            inserts = insert_times(client)
            watcher.stopping.set()
            watcher.join()
        finally:
            load.stopping.set()
            watcher.stopping.set()
            workers.stop_all()
            client.close()
        return report(broker, changes, watcher.views, inserts, published, rollouts, distinct, rows, trained, args)


async def _partitions(config: Config, bootstrap: str, names: list[str]) -> dict[str, int]:
    """How many partitions each of ``names`` has, as the broker says."""
    admin = admin_client(config, bootstrap)
    await admin.start()
    try:
        return await topic_partitions(admin, names)
    finally:
        await admin.close()


def report(broker: str, changes: list[Change], views: list[GroupView], inserts: list[float], published: int,
           rollouts: int, distinct: int, rows: int, trained: int, args: argparse.Namespace) -> int:
    """Print one line per change, then the totals; returns 1 when anything was stuck or lost."""
    measured = [(change, partition_pause(change, views, args.partitions),
                 partition_steady_gap(change, views, args.partitions)) for change in changes]
    for change, pause, steady in measured:
        clickhouse_gap = pause_after(change, inserts)
        emit(BENCH, "change", pause, "s", broker=broker, number=change.number, kind=change.kind,
             workers_after=change.workers_after, steady_gap_s=None if steady is None else round(steady, 3),
             clickhouse_gap_s=None if clickhouse_gap is None else round(clickhouse_gap, 3), state=change.state,
             unassigned=change.unassigned, stalled=change.stalled, ghosts=change.ghosts,
             missing_workers=change.missing_workers,
             idle_members=change.idle_members)
    pauses = [pause for _change, pause, _steady in measured if pause is not None]
    steady = [gap for _change, _pause, gap in measured if gap is not None]
    stuck = sum(change.stuck for change in changes)
    lost, untrained = published - distinct, rollouts - trained
    common = {"broker": broker, "minutes": args.minutes, "changes": len(changes), "rate_rollouts_per_s": args.rate,
              "partitions": args.partitions}
    emit(BENCH, "stuck", stuck, "count", **common,
         windows_stuck=sum(1 for change in changes if change.stuck))
    emit(BENCH, "spans_lost", lost, "spans", **common, published=published, stored=distinct,
         rows_before_merge=rows, rollouts=rollouts, rollouts_without_transitions=untrained)
    emit(BENCH, "rebalance_pause_median_s", median(pauses) if pauses else None, "s", **common,
         steady_gap_median_s=round(median(steady), 3) if steady else None)
    emit(BENCH, "rebalance_pause_max_s", max(pauses) if pauses else None, "s", **common,
         by_kind={kind: round(max((p for c, p, _s in measured if c.kind == kind and p is not None), default=0.0), 3)
                  for kind in sorted(set(CHANGES))},
         unresumed=sum(1 for _change, pause, _steady in measured if pause is None))
    emit(BENCH, "rebalances", rebalances(views), "rebalances", **common,
         note=f"changes of the coordinator's stable assignment, polled every {POLL_S} s")
    return 1 if stuck or lost or untrained else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=BROKERS, default="kafka")
    parser.add_argument("--minutes", type=float, default=20.0, help="how long membership keeps changing")
    parser.add_argument("--change-every", type=float, default=60.0, help="seconds between membership changes")
    parser.add_argument("--rate", type=float, default=40.0, help="rollouts of 16 spans published per second")
    parser.add_argument("--partitions", type=int, default=6, help="partitions of spans and transitions")
    parser.add_argument("--drain-s", type=float, default=180.0, help="how long the workers may take to catch up")
    sys.exit(run(parser.parse_args()))


if __name__ == "__main__":
    main()

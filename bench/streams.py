"""End-to-end figures of the stream processors, and the same workload on Agent Lightning's LightningStore.

publisher → Kafka → `agentstream streams` worker → rows queryable in ClickHouse, with 1 KB LLM
spans (rollouts of 15 LLM calls and a reward, between STARTED and SUCCEEDED events):
- ingest_spans_per_s: all spans published at full speed, until every one is counted in ClickHouse;
- transition_latency_p50_ms / _p99_ms: at half that load, SUCCEEDED event published → its
  transitions on the transitions topic (the Kafka record timestamp the worker's producer set);
- ingest_cpu_us_per_span: CPU microseconds per span of each process during the ingest run (the
  publisher, i.e. this process; the broker, tansu or Apache Kafka's JVM with all its threads; the
  object store, tansu's storage, which on Kafka holds only the checkpoint bucket; the worker;
  ClickHouse), from the processes' own counters (/proc/<pid>/stat), and their total;
- machine_calibration: the CPU model and two fixed workloads' times (stack/machine.py), so figures
  from different machines can be compared;
- ``--level trajectory``: the worker's [[credit]] rule trains at trajectory level, so it reads
  every call's token arrays and compares them with the last call's (this workload's calls are
  unrelated: every call after a rollout's first breaks the prefix, prefix_breaks_per_rollout 14);
  the figures carry the level;
- worker_rss_soak_slope_mb_per_min: ``--soak-minutes`` more of publishing at the measured ingest rate
  (full load) after the latency run; the worker's RSS every 30 s, and its least-squares slope over
  the second half (a leak grows it; a worker that holds more in flight than at the start does not);
- span_read_us_per_span: the worker's reading of a SpanBatch of 16 such spans into its nodes, in this process,
  compiled (the value) and by the Python reference reader (``reference``), before any stack starts;
- the peer: Agent Lightning 0.3.0's LightningStore HTTP server with runners in separate processes,
  on the same number of 1 KB spans, measured once before the brokers' runs and printed as "peer"
  with the "ratio" on each broker's ingest line.

Every figure is measured on each broker ``--broker`` names (tansu, Apache Kafka, or both, the
default), one private stack after the other, each after its own calibration line; every line names
its broker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import BROKER_STORAGES, LEVELS
from agentstream.infra.kafka import client_options, topic_name
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.schemas import HEADER_SIZE, AvroCodec
from agentstream.schemas.span_reader import ReferenceSpanReader, SpanReader
from agentstream.stack.machine import CpuShare, calibrate, resident_mb
from agentstream.streams.trajectory import SpanNode
from bench.common import (
    add_broker_option,
    chosen_brokers,
    cli_environ,
    emit,
    llm_span,
    percentile,
    private_stack,
    slope_per_hour,
)

SPANS_PER_ROLLOUT = 16
BENCH = "streams"


class Workload:
    """Rollouts of 15 LLM spans and a reward, built from a pool of pre-generated spans (generation is not measured)."""

    def __init__(self, seed: int = 7) -> None:
        rng = random.Random(seed)
        self.pool = [llm_span(rng, i) for i in range(256)]
        self.count = 0

    def rollout(self, publisher: SpanPublisher) -> tuple[str, float]:
        """Publish one rollout; returns its id and the wall time its SUCCEEDED event was handed over."""
        self.count += 1
        rollout_id = f"b{self.count:09d}"
        attempt = f"{rollout_id}-1"
        now = time.time_ns() // 1000
        event = {"rollout_id": rollout_id, "attempt_id": attempt, "task_id": f"t{self.count}",
                 "agent_name": "math-agent"}
        publisher.publish_event({**event, "event": "STARTED", "at_us": now})
        for index in range(SPANS_PER_ROLLOUT - 1):
            template = self.pool[(self.count * 7 + index) % len(self.pool)]
            publisher.publish({**template, "span_id": f"{rollout_id}-{index}", "rollout_id": rollout_id,
                               "attempt_id": attempt, "start_time_us": now + index, "end_time_us": now + index + 1})
        publisher.publish({"span_id": f"{rollout_id}-r", "rollout_id": rollout_id, "attempt_id": attempt,
                           "name": "reward", "kind": "REWARD", "start_time_us": now + 100, "end_time_us": now + 100,
                           "status": "OK", "agent_name": "math-agent", "attributes": {}, "reward": 1.0})
        ended = time.time()
        publisher.publish_event({**event, "event": "SUCCEEDED", "at_us": time.time_ns() // 1000})
        return rollout_id, ended


def start_worker(env: dict, log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen([sys.executable, "-m", "agentstream", "streams"], env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
    return process


def wait_ready(worker: subprocess.Popen, log_path: Path, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while b"Worker]: Ready" not in log_path.read_bytes():
        if worker.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the streams worker did not start:\n{log_path.read_text()[-2000:]}")
        time.sleep(0.2)


STAGES = {"bench (publisher)": "publisher", "agentstream streams": "worker", "broker": "broker",
          "objectstore": "objectstore", "clickhouse": "clickhouse"}
"""The ingest path's processes by their CpuShare labels (the schema registry and the rest are left out)."""


class TransitionWatcher(threading.Thread):
    """Reads the transitions topic and keeps, per rollout, the time its transitions' record was produced."""

    def __init__(self, options: dict, topic: str) -> None:
        super().__init__(daemon=True)
        self.options, self.topic = options, topic
        self.seen: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        consumer = AIOKafkaConsumer(self.topic, **self.options, auto_offset_reset="latest", enable_auto_commit=False)
        await consumer.start()
        try:
            while not self.stop.is_set():
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    for record in records:  # the worker names a record's rollouts in a header: no decoding here
                        for rollout_id in dict(record.headers)["agentstream-rollouts"].decode().split(","):
                            self.seen[rollout_id] = record.timestamp / 1000
        finally:
            await consumer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=12_500, help="rollouts of 16 spans for the ingest figure")
    parser.add_argument("--latency-seconds", type=float, default=15.0)
    parser.add_argument("--no-peer", action="store_true", help="skip Agent Lightning")
    parser.add_argument("--soak-minutes", type=float, default=10.0,
                        help="minutes of full load after the latency run, the worker's RSS sampled (0: none)")
    parser.add_argument("--broker-storage", choices=BROKER_STORAGES, default="durable",
                        help="tansu's storage (memory: no object store, what durability costs)")
    parser.add_argument("--level", choices=LEVELS, default="transition",
                        help="the [[credit]] level of the worker's rule (trajectory: calls compared and merged)")
    add_broker_option(parser)
    args = parser.parse_args()
    reading_figure()
    peer = None
    if not args.no_peer:
        from bench.peer_agentlightning import run_peer

        peer = run_peer(rollouts=2000, spans_per_rollout=8, runners=8)
    for broker in chosen_brokers(args.broker):
        measure(broker, args, peer)


def reading_figure(batches: int = 4000) -> None:
    """CPU microseconds per span to read a SpanBatch of 16 LLM spans, compiled and by the Python reference."""
    rng = random.Random(7)
    codec = AvroCodec()
    body = codec.encode_span_batch([llm_span(rng, index, "r1") for index in range(SPANS_PER_ROLLOUT)])
    _, _, schema = codec.writer_schema(body)
    cost = {}
    readers = {"compiled": SpanReader(schema, SpanNode), "reference": ReferenceSpanReader(schema, SpanNode)}
    for name, reader in readers.items():
        for _ in range(batches // 10):
            reader.batch(body[HEADER_SIZE:])
        start = time.thread_time()
        for _ in range(batches):
            reader.batch(body[HEADER_SIZE:])
        cost[name] = (time.thread_time() - start) / batches / SPANS_PER_ROLLOUT * 1e6
    emit(BENCH, "span_read_us_per_span", cost["compiled"], "us/span", reference=round(cost["reference"], 2),
         ratio=round(cost["reference"] / cost["compiled"], 1),
         span_bytes=(len(body) - HEADER_SIZE) // SPANS_PER_ROLLOUT)


def measure(broker: str, args: argparse.Namespace, peer: dict | None) -> None:
    """Every figure but the peer's on a private stack with ``broker``, after a calibration line; each line names
    the broker, and the ingest line carries the peer's figure (measured once, before) and the ratio."""
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", broker=broker, **calibration.as_dict())
    storage = args.broker_storage if broker == "tansu" else "log dirs"  # Kafka writes its own logs to disk
    with (private_stack(AGENTSTREAM_BROKER=broker, AGENTSTREAM_BROKER_STORAGE=args.broker_storage) as (config,
                                                                                                        endpoints),
          tempfile.TemporaryDirectory() as scratch):
        env = cli_environ(endpoints, scratch)
        if args.level != "transition":
            (Path(scratch) / "agentstream.toml").write_text(f'[[credit]]\nlevel = "{args.level}"\n')
            env["AGENTSTREAM_CONFIG"] = str(Path(scratch) / "agentstream.toml")
        options = client_options(config.kafka, endpoints.bootstrap_servers)
        worker = start_worker(env, Path(scratch) / "worker.log")
        client = connect(config.clickhouse, endpoints.clickhouse_url, database=config.clickhouse.database)
        try:
            wait_ready(worker, Path(scratch) / "worker.log")
            rss_start = resident_mb(worker.pid)
            if os.environ.get("BENCH_PROFILE"):  # py-spy's collapsed stacks of the worker, for looking at hot spots
                subprocess.Popen(["py-spy", "record", "--pid", str(worker.pid), "--duration", "20", "--format", "raw",
                                  "-o", os.environ["BENCH_PROFILE"]],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            workload = Workload()
            with SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=Path(scratch) / "journal") as publisher:
                total = args.rollouts * SPANS_PER_ROLLOUT
                with CpuShare("bench (publisher)", calibration.cores) as meter:
                    started = time.perf_counter()
                    for _ in range(args.rollouts):
                        workload.rollout(publisher)
                    publisher.flush(120)
                    published = time.perf_counter()
                    while client.query("SELECT count() FROM spans").result_rows[0][0] < total:
                        if time.perf_counter() - started > 300 or worker.poll() is not None:
                            kept = Path(tempfile.gettempdir()) / "agentstream-bench-worker.log"
                            kept.write_text((Path(scratch) / "worker.log").read_text())
                            raise RuntimeError(f"spans did not all arrive; the worker's log is kept at {kept}")
                        time.sleep(0.1)
                    elapsed = time.perf_counter() - started
                cpu = {STAGES[label]: seconds for label, seconds in meter.seconds_by_label().items()
                       if label in STAGES}
                ours = total / elapsed
                emit(BENCH, "publish_phase_spans_per_s", total / (published - started), "spans/s", spans=total,
                     broker=broker)
                per_span = {stage: seconds / total * 1e6 for stage, seconds in cpu.items()}
                emit(BENCH, "ingest_cpu_us_per_span", sum(per_span.values()), "us/span",
                     by_stage={stage: round(us, 1) for stage, us in per_span.items()},
                     cpu_seconds={stage: round(seconds, 2) for stage, seconds in cpu.items()},
                     wall_seconds=round(elapsed, 2), spans=total, cores=calibration.cores,
                     broker=broker, broker_storage=storage, level=args.level,
                     note="publisher = this process (its ClickHouse count query every 0.1 s included)")
                for stage, us in per_span.items():
                    emit(BENCH, f"ingest_cpu_us_per_span_{stage}", us, "us/span", broker=broker)

                watcher = TransitionWatcher(options, topic_name(config.topics, "transitions"))
                watcher.start()
                time.sleep(2)
                rate = ours / 2 / SPANS_PER_ROLLOUT  # rollouts per second at half the measured ingest load
                ended: dict[str, float] = {}
                begin = time.perf_counter()
                while time.perf_counter() - begin < args.latency_seconds:
                    due = begin + len(ended) / rate
                    pause = due - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                    rollout_id, at = workload.rollout(publisher)
                    ended[rollout_id] = at
                publisher.flush(60)
                deadline = time.monotonic() + 60
                latencies = []
                for rollout_id, at in ended.items():
                    while rollout_id not in watcher.seen and time.monotonic() < deadline:
                        time.sleep(0.05)
                    if rollout_id in watcher.seen:
                        latencies.append((watcher.seen[rollout_id] - at) * 1000)
                watcher.stop.set()
                rss_end = resident_mb(worker.pid)
                if args.soak_minutes > 0:
                    soak(workload, publisher, client, worker, ours, args.soak_minutes, broker)
            missing = len(ended) - len(latencies)
            extra = {"broker": broker, "spans": total, "seconds": round(elapsed, 2), "span_bytes": 1000, "workers": 1,
                     "level": args.level}
            if peer:
                extra.update(peer=round(peer["spans_per_s"], 1), ratio=round(ours / peer["spans_per_s"], 1),
                             peer_system="agentlightning==0.3.0 LightningStore (HTTP server, 8 runner processes, "
                                         f"{peer['path']})")
            emit(BENCH, "ingest_spans_per_s", ours, "spans/s", **extra)
            load = {"broker": broker, "load_spans_per_s": round(ours / 2), "rollouts": len(ended), "missing": missing,
                    "level": args.level}
            emit(BENCH, "transition_latency_p50_ms", percentile(latencies, 0.5), "ms", **load)
            emit(BENCH, "transition_latency_p99_ms", percentile(latencies, 0.99), "ms", **load)
            emit(BENCH, "worker_rss_mb", rss_end, "MB", at_start=round(rss_start, 1), broker=broker,
                 note="after the ingest and latency runs, before the soak")
            merges, breaks, rollouts = client.query(
                "SELECT sum(prefix_merges), sum(prefix_breaks), count() FROM rollouts FINAL").result_rows[0]
            emit(BENCH, "prefix_breaks_per_rollout", breaks / max(rollouts, 1), "breaks", level=args.level,
                 broker=broker, prefix_merges_per_rollout=round(merges / max(rollouts, 1), 3), rollouts=rollouts)
            if os.environ.get("BENCH_WORKER_LOG"):
                Path(os.environ["BENCH_WORKER_LOG"]).write_text((Path(scratch) / "worker.log").read_text())
        finally:
            client.close()
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()


def soak(workload: Workload, publisher: SpanPublisher, client, worker: subprocess.Popen, spans_per_s: float,
         minutes: float, broker: str, sample_every_s: float = 30.0) -> None:
    """Publish at ``spans_per_s`` for ``minutes``, sampling the worker's RSS; prints its slope over the second half."""
    rate = spans_per_s / SPANS_PER_ROLLOUT
    samples: list[tuple[float, float]] = [(0.0, resident_mb(worker.pid))]
    begin = time.perf_counter()
    published = 0
    print(f"soak: {minutes:g} min at {spans_per_s:,.0f} spans/s on {broker}, the worker's RSS every "
          f"{sample_every_s:.0f} s", file=sys.stderr, flush=True)
    while (now := time.perf_counter() - begin) < minutes * 60:
        if worker.poll() is not None:
            raise RuntimeError(f"the streams worker exited during the soak (code {worker.returncode})")
        if now - samples[-1][0] >= sample_every_s:
            samples.append((now, resident_mb(worker.pid)))
            print(f"soak: {now / 60:4.1f} min, worker RSS {samples[-1][1]:.0f} MB", file=sys.stderr, flush=True)
        pause = begin + published / rate - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        workload.rollout(publisher)
        published += 1
    publisher.flush(120)
    samples.append((time.perf_counter() - begin, resident_mb(worker.pid)))
    expected = workload.count * SPANS_PER_ROLLOUT  # every span this stack was sent, the earlier runs' included
    backlog_deadline = time.monotonic() + 300
    while (stored := client.query("SELECT count() FROM spans").result_rows[0][0]) < expected:
        if time.monotonic() > backlog_deadline:
            break
        time.sleep(1.0)
    drained = time.perf_counter() - begin - samples[-1][0]
    slope = slope_per_hour(samples[len(samples) // 2:]) / 60
    emit(BENCH, "worker_rss_soak_slope_mb_per_min", slope, "MB/min", broker=broker, minutes=minutes,
         load_spans_per_s=round(spans_per_s), spans=published * SPANS_PER_ROLLOUT, stored_of_sent=[stored, expected],
         drain_seconds_after=round(drained, 1),
         rss_mb=[[round(t / 60, 2), round(mb, 1)] for t, mb in samples],
         note="least squares over the second half's samples; rss_mb is [minutes, MB]; drain: after the last "
              "publish until ClickHouse counted every span sent")


if __name__ == "__main__":
    main()

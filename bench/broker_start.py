"""What each embedded broker costs the one-command stack: `agentstream up` time and the broker's resident memory.

For each broker ``--broker`` names (tansu, Apache Kafka, or both, the default), after a machine
calibration line, ``--repeats`` times in a fresh stack home on free loopback ports:

- up_s: wall seconds of the real `agentstream up` command on a fresh home (for Kafka this includes
  formatting its storage), and restart_up_s: `agentstream down` then `up` again over the kept data;
- broker_listening_s: from the object store's start line to the broker's (its port open), the broker's
  own share of ``up``;
- broker_rss_mb: the broker process's resident memory (VmRSS) idle after `up`, and after
  ``--messages`` 1 KB records were produced (acks=all) and consumed back; the object store's beside it
  (tansu's storage; on Kafka it holds only the checkpoint bucket).

Prints one JSON line per figure, each naming its broker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from agentstream.infra.config import load_config
from agentstream.infra.kafka import client_options
from agentstream.infra.processes import ServiceDirectory
from agentstream.stack.control import BROKER, OBJECTSTORE
from agentstream.stack.machine import calibrate, resident_mb
from bench.common import add_broker_option, chosen_brokers, emit, private_environ

BENCH = "broker_start"


def agentstream(command: str, env: dict[str, str]) -> list[tuple[float, str]]:
    """Run ``agentstream <command>`` to its end; returns its output lines, each with the seconds since the start
    when it was read."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "agentstream", command], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    lines = [(time.perf_counter() - started, line.rstrip()) for line in process.stdout]
    if process.wait() != 0:
        raise RuntimeError(f"agentstream {command} failed:\n" + "\n".join(line for _at, line in lines[-20:]))
    lines.append((time.perf_counter() - started, ""))
    return lines


def line_at(lines: list[tuple[float, str]], prefix: str) -> float:
    """When the first output line starting with ``prefix`` was read."""
    return next(at for at, line in lines if line.startswith(prefix))


def service_rss_mb(home: Path, name: str) -> float | None:
    """Resident memory of the service `up` started under ``home`` as ``name``; None when it is not running."""
    record = ServiceDirectory(home).record(name)
    return resident_mb(record.pid) if record is not None and record.alive() else None


async def exercise(options: dict, messages: int) -> None:
    """Produce ``messages`` 1 KB records to the spans topic (acks=all) and read them back, so the broker has
    held and served some data before its memory is read again."""
    topic, payload = "agentstream.spans", os.urandom(1024)
    producer = AIOKafkaProducer(**options, acks="all", linger_ms=10, max_batch_size=1 << 20)
    await producer.start()
    try:
        for index in range(messages):
            await producer.send(topic, key=str(index % 64).encode(), value=payload)
        await producer.flush()
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, **options, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        received = 0
        while received < messages:
            batch = await consumer.getmany(timeout_ms=1000, max_records=50_000)
            received += sum(len(records) for records in batch.values())
    finally:
        await consumer.stop()


def measure(broker: str, messages: int) -> dict[str, float | None]:
    """One fresh stack home: up, memory idle, memory after traffic, down, up again over the data, down."""
    with tempfile.TemporaryDirectory(prefix="agentstream-bench-") as home:
        environ = private_environ(home, AGENTSTREAM_BROKER=broker)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))},
               **environ}
        config = load_config(environ=environ)
        stack_home = config.stack.home.resolve()
        lines = agentstream("up", env)
        try:
            figures: dict[str, float | None] = {
                "up_s": lines[-1][0],
                "broker_listening_s": line_at(lines, "broker") - line_at(lines, "objectstore"),
                "broker_rss_idle_mb": service_rss_mb(stack_home, BROKER),
                "objectstore_rss_idle_mb": service_rss_mb(stack_home, OBJECTSTORE),
            }
            options = client_options(config.kafka, f"{config.stack.host}:{config.stack.broker_port}")
            asyncio.run(exercise(options, messages))
            figures["broker_rss_loaded_mb"] = service_rss_mb(stack_home, BROKER)
            figures["objectstore_rss_loaded_mb"] = service_rss_mb(stack_home, OBJECTSTORE)
            agentstream("down", env)
            figures["restart_up_s"] = agentstream("up", env)[-1][0]
        finally:
            agentstream("down", env)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="fresh stack homes per broker")
    parser.add_argument("--messages", type=int, default=100_000, help="1 KB records through the broker")
    add_broker_option(parser)
    args = parser.parse_args()
    for broker in chosen_brokers(args.broker):
        calibration = calibrate()
        emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", broker=broker, **calibration.as_dict())
        runs = [measure(broker, args.messages) for _ in range(args.repeats)]
        for name in runs[0]:
            values = [run[name] for run in runs if run[name] is not None]
            unit = "s" if name.endswith("_s") else "MB"
            emit(BENCH, name, statistics.median(values) if values else None, unit, broker=broker,
                 runs=[round(value, 3) for value in values], messages=args.messages)


if __name__ == "__main__":
    main()

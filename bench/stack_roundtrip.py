"""Round-trip latency and throughput of the local stack itself: its broker and ClickHouse over HTTP.

For each broker ``--broker`` names (tansu, Apache Kafka, or both, the default): a machine calibration line,
then a private stack on free loopback ports with that broker, the figures, the stack stopped. Prints one
JSON line per figure, each naming its broker.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import os
import statistics
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from agentstream.infra.clickhouse import connect
from agentstream.infra.kafka import client_options
from agentstream.stack.machine import calibrate
from bench.common import add_broker_option, chosen_brokers, percentile, private_stack
from bench.common import emit as emit_figure


async def kafka_figures(options: dict, emit: Callable[..., None]) -> None:
    """Produce-to-consume round trips of one small record (acks=all), then a 1 KB flood produced and consumed."""
    admin = AIOKafkaAdminClient(**options)
    await admin.start()
    await admin.create_topics([NewTopic("bench.ping", 1, 1), NewTopic("bench.flood", 4, 1)])
    await admin.close()

    producer = AIOKafkaProducer(**options, acks="all", linger_ms=0)
    consumer = AIOKafkaConsumer("bench.ping", **options, auto_offset_reset="latest", fetch_max_wait_ms=5)
    await producer.start()
    await consumer.start()
    await consumer.getmany(timeout_ms=200)
    latencies = []
    for i in range(300):
        started = time.perf_counter()
        await producer.send_and_wait("bench.ping", value=str(i).encode())
        while True:
            batch = await consumer.getmany(timeout_ms=1000)
            if any(r.value == str(i).encode() for records in batch.values() for r in records):
                break
        latencies.append((time.perf_counter() - started) * 1000)
    await consumer.stop()
    await producer.stop()
    emit("kafka_roundtrip_p50_ms", statistics.median(latencies), "ms", samples=len(latencies))
    emit("kafka_roundtrip_p99_ms", percentile(latencies, 0.99), "ms", samples=len(latencies))

    count, payload = 200_000, os.urandom(1024)
    producer = AIOKafkaProducer(**options, acks="all", linger_ms=10, max_batch_size=1 << 20)
    await producer.start()
    started = time.perf_counter()
    for i in range(count):
        await producer.send("bench.flood", key=str(i % 64).encode(), value=payload)
    await producer.flush()
    elapsed = time.perf_counter() - started
    await producer.stop()
    emit("kafka_produce_msgs_per_s", count / elapsed, "msg/s", message_bytes=1024)

    consumer = AIOKafkaConsumer("bench.flood", **options, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=8 << 20, fetch_max_bytes=32 << 20)
    await consumer.start()
    received, started = 0, time.perf_counter()
    while received < count:
        batch = await consumer.getmany(timeout_ms=1000, max_records=50_000)
        received += sum(len(records) for records in batch.values())
    elapsed = time.perf_counter() - started
    await consumer.stop()
    emit("kafka_consume_msgs_per_s", received / elapsed, "msg/s", message_bytes=1024)


def clickhouse_figures(config, url: str, emit: Callable[..., None]) -> None:
    """Batched inserts, a GROUP BY and point queries over the stack's ClickHouse HTTP front."""
    client = connect(config.clickhouse, url)
    client.command("CREATE TABLE IF NOT EXISTS default.bench_rows (id UInt64, at DateTime64(6), name String, "
                   "value Float64, tokens Array(UInt32)) ENGINE = MergeTree ORDER BY id")
    now = datetime.datetime.now(datetime.UTC)
    rows = [[i, now, f"span-{i % 100}", i * 0.5, list(range(i % 16))] for i in range(200_000)]
    started = time.perf_counter()
    for offset in range(0, len(rows), 20_000):
        client.insert("default.bench_rows", rows[offset:offset + 20_000],
                      column_names=["id", "at", "name", "value", "tokens"])
    elapsed = time.perf_counter() - started
    emit("clickhouse_insert_rows_per_s", len(rows) / elapsed, "rows/s", batch_rows=20_000)
    latencies = []
    for _ in range(100):
        started = time.perf_counter()
        client.query("SELECT name, count(), avg(value) FROM default.bench_rows GROUP BY name")
        latencies.append((time.perf_counter() - started) * 1000)
    emit("clickhouse_groupby_p50_ms", statistics.median(latencies), "ms", rows=len(rows))
    latencies = []
    for i in range(300):
        started = time.perf_counter()
        client.query("SELECT {i:UInt64}", parameters={"i": i})
        latencies.append((time.perf_counter() - started) * 1000)
    emit("clickhouse_point_query_p50_ms", statistics.median(latencies), "ms")
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_broker_option(parser)
    args = parser.parse_args()
    for broker in chosen_brokers(args.broker):
        emit = functools.partial(emit_figure, "stack", broker=broker)
        calibration = calibrate()
        emit("machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
        with private_stack(AGENTSTREAM_BROKER=broker) as (config, endpoints):
            asyncio.run(kafka_figures(client_options(config.kafka, endpoints.bootstrap_servers), emit))
            clickhouse_figures(config, endpoints.clickhouse_url, emit)


if __name__ == "__main__":
    main()

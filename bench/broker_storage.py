"""What durable broker storage costs and buys: produce latency and throughput, memory:// vs the object store.

For each storage, a private stack on free loopback ports: produce latency (one 1 KB record at
a time, acks=all), produce and consume throughput (1 KB records, batched, 4 partitions); for
durable storage also how long a SIGKILLed broker takes to serve again and whether the records
and the committed group offsets are still there. Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from agentstream.infra.kafka import client_options
from agentstream.stack.control import BROKER, Stack
from bench.common import emit as emit_figure
from bench.common import percentile, private_stack

emit = functools.partial(emit_figure, "broker_storage")
VALUE = b"x" * 1024


async def produce_figures(options: dict, storage: str, records: int) -> None:
    admin = AIOKafkaAdminClient(**options)
    await admin.start()
    await admin.create_topics([NewTopic("bench.ping", 1, 1), NewTopic("bench.flood", 4, 1)])
    await admin.close()
    producer = AIOKafkaProducer(**options, acks="all", linger_ms=0)
    await producer.start()
    latencies = []
    for _ in range(200):
        started = time.perf_counter()
        await producer.send_and_wait("bench.ping", value=VALUE)
        latencies.append((time.perf_counter() - started) * 1000)
    await producer.stop()
    emit("produce_latency_p50", percentile(latencies, 0.5), "ms", storage=storage)
    emit("produce_latency_p99", percentile(latencies, 0.99), "ms", storage=storage)

    producer = AIOKafkaProducer(**options, acks="all", linger_ms=5, max_batch_size=256 * 1024)
    await producer.start()
    started = time.perf_counter()
    sent = [await producer.send("bench.flood", key=str(n % 64).encode(), value=VALUE) for n in range(records)]
    await asyncio.gather(*sent)
    elapsed = time.perf_counter() - started
    await producer.stop()
    emit("produce_throughput", records / elapsed, "records/s", storage=storage, record_bytes=len(VALUE))

    consumer = AIOKafkaConsumer("bench.flood", **options, auto_offset_reset="earliest", group_id="bench-flood",
                                enable_auto_commit=False, max_partition_fetch_bytes=4 << 20)
    await consumer.start()
    started = time.perf_counter()
    read = 0
    while read < records:
        for records_read in (await consumer.getmany(timeout_ms=2000, max_records=10_000)).values():
            read += len(records_read)
    elapsed = time.perf_counter() - started
    await consumer.commit()
    await consumer.stop()
    emit("consume_throughput", read / elapsed, "records/s", storage=storage)


async def read_back(options: dict) -> tuple[int, int]:
    """(records on bench.flood, sum of bench-flood's committed offsets)."""
    consumer = AIOKafkaConsumer(**options, group_id="bench-flood", enable_auto_commit=False,
                                max_partition_fetch_bytes=4 << 20)
    await consumer.start()
    try:
        partitions = [TopicPartition("bench.flood", p) for p in range(4)]
        consumer.assign(partitions)
        committed = sum([(await consumer.committed(tp)) or 0 for tp in partitions])
        await consumer.seek_to_beginning(*partitions)
        count = 0
        while batch := await consumer.getmany(timeout_ms=1500, max_records=10_000):
            count += sum(len(records) for records in batch.values())
        return count, committed
    finally:
        await consumer.stop()


def restart_figures(stack: Stack, options: dict, records: int) -> None:
    """SIGKILL the broker, start it again, time it, and check records and offsets."""
    record = stack.services.record(BROKER)
    assert record is not None
    os.kill(record.pid, signal.SIGKILL)
    while record.alive():
        time.sleep(0.01)
    started = time.perf_counter()
    stack.up(progress=lambda line: None)
    emit("restart_until_serving", time.perf_counter() - started, "s", storage="durable",
         includes="object store already up; tansu start, topic check, ClickHouse migration check")
    count, committed = asyncio.run(read_back(options))
    emit("records_after_sigkill", count, "records", storage="durable", expected=records)
    emit("committed_offsets_after_sigkill", committed, "records", storage="durable", expected=records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=20_000)
    args = parser.parse_args()
    for storage in ("memory", "durable"):
        started = time.perf_counter()
        with private_stack(AGENTSTREAM_BROKER_STORAGE=storage) as (config, endpoints):
            emit("stack_up", time.perf_counter() - started, "s", storage=storage)
            options = client_options(config.kafka, endpoints.bootstrap_servers)
            asyncio.run(produce_figures(options, storage, args.records))
            if storage == "durable":
                restart_figures(Stack(config), options, args.records)


if __name__ == "__main__":
    main()

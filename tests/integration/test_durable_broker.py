"""The embedded broker's durable storage: nothing it acknowledged is lost to a SIGKILL, a restart or `down`/`up`.

Each test runs a broker of its own (tansu over the S3 object store, on free ports, in the
test's folder) next to the session's ClickHouse, so killing it disturbs no other test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import Config, load_config
from agentstream.infra.kafka import client_options, topic_name
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.stack.control import BROKER, OBJECTSTORE, Endpoints, Stack
from tests.conftest import stack_environment
from tests.integration.test_publisher import make_span
from tests.support.streams_harness import Worker, rollout_records, wait_for, worker_env

GROUP = "durability-check"


def private_stack(home: Path, clickhouse_url: str, database: str, prefix: str) -> Stack:
    """A durable broker of this test's own; ClickHouse is the session's (external here, so nothing else starts)."""
    config = load_config(environ={
        **stack_environment(home), "AGENTSTREAM_BROKER_STORAGE": "durable", "CLICKHOUSE_URL": clickhouse_url,
        "CLICKHOUSE_DATABASE": database, "AGENTSTREAM_TOPIC_PREFIX": prefix,
    })
    return Stack(config)


def start(running: Stack) -> Endpoints:
    """``up``, and on failure ``down`` whatever it had started already, so no process outlives the test."""
    try:
        return running.up(timeout_s=60, progress=lambda line: None)
    except BaseException:
        running.down(progress=lambda line: None)
        raise


@pytest.fixture
def durable(tmp_path: Path, stack: Endpoints, stack_config: Config):
    """(Stack, Endpoints) of a running private durable broker; stopped, and its database dropped, afterwards."""
    tag = uuid.uuid4().hex[:8]
    running = private_stack(tmp_path / "stack", stack.clickhouse_url, f"durable_{tag}", f"d{tag}.")
    endpoints = start(running)
    yield running, endpoints
    running.down(progress=lambda line: None)
    client = connect(stack_config.clickhouse, stack.clickhouse_url)
    client.command(f"DROP DATABASE IF EXISTS durable_{tag}")
    client.close()


def kill_broker(running: Stack) -> None:
    """SIGKILL the broker process (no flush, no goodbye) and wait until it is gone."""
    record = running.services.record(BROKER)
    assert record is not None and record.alive()
    os.kill(record.pid, signal.SIGKILL)
    while record.alive():
        try:
            os.waitpid(record.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.02)


def produce_and_commit(config: Config, bootstrap: str, topic: str, count: int, consume: int) -> None:
    """Produce ``count`` records (acks=all, each awaited), then consume ``consume`` of them in GROUP and commit."""

    async def go() -> None:
        options = client_options(config.kafka, bootstrap)
        producer = AIOKafkaProducer(**options, acks="all", linger_ms=5)
        await producer.start()
        try:
            sent = [await producer.send(topic, key=f"k{n % 16}".encode(), value=f"v{n}".encode())
                    for n in range(count)]
            await asyncio.gather(*sent)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(topic, **options, group_id=GROUP, enable_auto_commit=False,
                                    auto_offset_reset="earliest", session_timeout_ms=3000, heartbeat_interval_ms=500)
        await consumer.start()
        try:
            read = 0
            while read < consume:
                for tp, records in (await consumer.getmany(timeout_ms=500, max_records=consume - read)).items():
                    read += len(records)
                    await consumer.commit({tp: records[-1].offset + 1})
        finally:
            await consumer.stop()

    asyncio.run(go())


def read_back(config: Config, bootstrap: str, topic: str) -> tuple[Counter[bytes], dict[int, int]]:
    """Every value on the topic (from the beginning) and GROUP's committed offset per partition."""

    async def go() -> tuple[Counter[bytes], dict[int, int]]:
        options = client_options(config.kafka, bootstrap)
        consumer = AIOKafkaConsumer(**options, group_id=GROUP, enable_auto_commit=False)
        await consumer.start()
        try:
            partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            if not partitions:
                await consumer._client.force_metadata_update()
                partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            consumer.assign(partitions)
            committed = {tp.partition: (await consumer.committed(tp)) or 0 for tp in partitions}
            await consumer.seek_to_beginning(*partitions)
            values: Counter[bytes] = Counter()
            while batch := await consumer.getmany(timeout_ms=1500):
                for records in batch.values():
                    values.update(record.value for record in records)
            return values, committed
        finally:
            await consumer.stop()

    return asyncio.run(go())


def check_survives(running: Stack, bootstrap: str, restart) -> None:  # type: ignore[no-untyped-def]
    config = running.config
    topic = topic_name(config.topics, "spans")
    produce_and_commit(config, bootstrap, topic, 400, consume=150)
    values_before, committed_before = read_back(config, bootstrap, topic)
    assert sum(values_before.values()) == 400 and sum(committed_before.values()) >= 150

    started = time.monotonic()
    restart()
    restart_s = time.monotonic() - started

    values_after, committed_after = read_back(config, running.endpoints().bootstrap_servers, topic)
    assert values_after == Counter(f"v{n}".encode() for n in range(400)), "every acknowledged record is back"
    assert committed_after == committed_before, "committed group offsets are back"
    # New records continue after the old ones: nothing is overwritten at offset 0.
    produce_and_commit(config, running.endpoints().bootstrap_servers, topic, 10, consume=0)
    values_more, _ = read_back(config, running.endpoints().bootstrap_servers, topic)
    assert sum(values_more.values()) == 410
    print(f"restart took {restart_s:.2f}s")


def test_acknowledged_records_and_group_offsets_survive_a_broker_sigkill(durable):
    running, endpoints = durable
    store_before = running.services.record(OBJECTSTORE)

    def sigkill_and_restart() -> None:
        kill_broker(running)
        running.up(timeout_s=60, progress=lambda line: None)

    check_survives(running, endpoints.bootstrap_servers, sigkill_and_restart)
    store_after = running.services.record(OBJECTSTORE)
    assert store_before is not None and store_after is not None and store_after.pid == store_before.pid


def test_acknowledged_records_and_group_offsets_survive_down_and_up(durable):
    running, endpoints = durable

    def down_and_up() -> None:
        running.down(progress=lambda line: None)
        assert running.services.record(BROKER) is None and running.services.record(OBJECTSTORE) is None
        running.up(timeout_s=60, progress=lambda line: None)

    check_survives(running, endpoints.bootstrap_servers, down_and_up)
    status = running.status()
    assert status.services[OBJECTSTORE].endswith(" running") and status.broker_reachable


def test_spans_published_while_the_broker_is_sigkilled_all_reach_clickhouse(durable, tmp_path, stack_config):
    """The issue's fault 4: a publisher under load, the broker SIGKILLed for seconds and restarted, the stream
    worker running throughout: every span the publisher accepted is in ClickHouse, once."""
    running, endpoints = durable
    config = running.config
    database = config.clickhouse.database
    env = worker_env(tmp_path, endpoints, config.topics.prefix, database,
                     f'[streams]\napp_id = "durable-{database}"\nsession_timeout_s = 3\n')
    worker = Worker(env, tmp_path / "worker.log").start()
    publisher = SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=tmp_path / "journal", linger_ms=5,
                              request_timeout_ms=1500, probe_interval_s=0.2).start()
    published = 0
    stop = threading.Event()

    def publish_continuously() -> None:
        nonlocal published
        while not stop.is_set():
            for _ in range(20):
                publisher.publish(make_span(f"ro-{published % 16}", published, tokens=30))
                published += 1
            time.sleep(0.01)

    thread = threading.Thread(target=publish_continuously)
    thread.start()
    try:
        time.sleep(2.0)
        kill_broker(running)
        time.sleep(3.0)
        running.up(timeout_s=60, progress=lambda line: None)
        time.sleep(2.0)
    finally:
        stop.set()
        thread.join(30)
        publisher.close(60)
    stats = publisher.stats()
    assert stats.spans_journaled > 0, "the outage was long enough for the publisher to notice"
    assert (stats.spans_published + stats.spans_replayed, stats.records_dropped) == (published, 0)
    client = connect(stack_config.clickhouse, endpoints.clickhouse_url)
    try:
        wait_for(lambda: client.query(f"SELECT count(), uniqExact(span_id) FROM {database}.spans FINAL")
                 .result_rows[0], 120, what="every published span in ClickHouse", equals=(published, published))
        assert worker.process.poll() is None, "the stream worker rode out the broker's outage"
    finally:
        client.close()
        worker.stop()


@pytest.mark.own_broker  # holds back tansu's objects in its store; Apache Kafka has no such store to reach into
def test_a_batch_stored_after_a_later_one_is_read_again_not_skipped(durable, tmp_path, stack_config):
    """tansu's durable storage takes a batch's offsets before it stores the batch: with two producers on one
    partition, a fetch can find a later batch while an earlier one is not stored yet. Here the earlier
    rollout's objects are held back, as if their puts were slow; the worker must wait for them, not pass them."""
    running, endpoints = durable
    config = running.config
    database = config.clickhouse.database
    topic = topic_name(config.topics, "spans")
    toml = f'[kafka]\nread_gap_patience_s = 120\n[streams]\napp_id = "gaps-{database}"\nsession_timeout_s = 3\n'
    env = worker_env(tmp_path, endpoints, config.topics.prefix, database, toml)

    async def produce_one_batch_each(rollout_id: str) -> list[int]:
        producer = AIOKafkaProducer(bootstrap_servers=endpoints.bootstrap_servers, acks="all")
        await producer.start()
        try:
            return [(await producer.send_and_wait(topic, value, key=rollout_id.encode(), partition=0)).offset
                    for value in rollout_records(rollout_id)]
        finally:
            await producer.stop()

    client = connect(stack_config.clickhouse, endpoints.clickhouse_url)

    def stored() -> dict[str, int]:
        return dict(client.query(f"SELECT rollout_id, count() FROM {database}.spans FINAL GROUP BY rollout_id")
                    .result_rows)

    asyncio.run(produce_one_batch_each("before"))  # read and committed: the worker comes back past it
    worker = Worker(env, tmp_path / "worker.log").start()
    try:
        wait_for(stored, 60, what="the first rollout stored", equals={"before": 1})
    finally:
        worker.stop()

    early = asyncio.run(produce_one_batch_each("early"))
    store = running.services.record(OBJECTSTORE)
    assert store is not None
    cluster = next((running.broker_data / "tansu" / "clusters").iterdir()).name
    urls = [f"http://{store.address}/tansu/clusters/{cluster}/topics/{topic}/partitions/0000000000/records/"
            f"{offset:020}.batch" for offset in early]
    held = {}
    for url in urls:  # through the store's S3 API, so the broker's listing no longer has them either
        with urllib.request.urlopen(url) as answer:
            held[url] = answer.read()
        urllib.request.urlopen(urllib.request.Request(url, method="DELETE")).close()
    asyncio.run(produce_one_batch_each("late"))

    worker = Worker(env, tmp_path / "worker.log").start()
    try:
        wait_for(lambda: "are not readable yet" in worker.log(), 60, what="the worker noticing the hole")
        time.sleep(2.0)
        assert stored() == {"before": 1}, "the late rollout waits behind the hole; it is not read past it"
        for url, data in held.items():
            urllib.request.urlopen(urllib.request.Request(url, data=data, method="PUT")).close()
        wait_for(stored, 60, what="every rollout stored", equals={"before": 1, "early": 1, "late": 1})
        assert "appeared when read again" in worker.log()
    finally:
        worker.stop()
        client.close()


@pytest.mark.own_broker
def test_memory_storage_is_still_available_explicitly(tmp_path: Path, stack: Endpoints):
    running = private_stack(tmp_path / "stack", stack.clickhouse_url, "agentstream", "m.")
    running = Stack(replace(running.config, stack=replace(running.config.stack, broker_storage="memory")))
    record_command: list[str] = []
    start(running)
    try:
        broker = running.services.record(BROKER)
        assert broker is not None
        record_command = broker.command
        assert running.services.record(OBJECTSTORE) is None
    finally:
        running.down(progress=lambda line: None)
    assert "memory://tansu/" in record_command

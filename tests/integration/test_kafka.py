"""The embedded broker through two independent Kafka clients: aiokafka (ours) and confluent-kafka."""

from __future__ import annotations

import asyncio
import uuid

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from agentstream.infra.kafka import ensure_topics, message_counts, product_topics, topic_partitions

PRODUCT_ROLES = {"tasks", "spans", "transitions", "checkpoints", "deployments", "dlq"}


async def _create_topic(options: dict, name: str, partitions: int = 4) -> None:
    admin = AIOKafkaAdminClient(**options)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()


def test_up_created_the_product_topics_with_their_layout(stack_config, kafka_options):
    async def check():
        admin = AIOKafkaAdminClient(**kafka_options)
        await admin.start()
        try:
            specs = product_topics(stack_config.topics)
            layout = await topic_partitions(admin, [s.name for s in specs])
            again = await ensure_topics(admin, specs)
            return specs, layout, again
        finally:
            await admin.close()

    specs, layout, created_again = asyncio.run(check())
    assert {s.role for s in specs} == PRODUCT_ROLES
    assert layout == {s.name: s.partitions for s in specs}
    assert layout[f"{stack_config.topics.prefix}spans"] == stack_config.topics.partitions
    assert layout[f"{stack_config.topics.prefix}checkpoints"] == 1
    assert next(s for s in specs if s.role == "checkpoints").configs["cleanup.policy"] == "compact"
    assert next(s for s in specs if s.role == "deployments").configs["cleanup.policy"] == "compact"
    assert created_again == [], "ensuring existing topics must not create anything"


def test_ensure_topics_honours_prefix_and_partitions(topics_config, kafka_options):
    config = topics_config
    specs = [s.__class__(s.role, s.name, 3 if s.role == "spans" else s.partitions, s.configs)
             for s in product_topics(config.topics)]

    async def go():
        admin = AIOKafkaAdminClient(**kafka_options)
        await admin.start()
        try:
            created = await ensure_topics(admin, specs)
            return created, await topic_partitions(admin, [s.name for s in specs])
        finally:
            await admin.close()

    created, layout = asyncio.run(go())
    assert sorted(created) == sorted(s.name for s in specs)
    assert all(name.startswith(config.topics.prefix) for name in created)
    assert layout[f"{config.topics.prefix}spans"] == 3


def test_aiokafka_round_trip_with_a_consumer_group(kafka_options, unique_prefix):
    topic = f"{unique_prefix}roundtrip"

    async def go():
        await _create_topic(kafka_options, topic)
        producer = AIOKafkaProducer(**kafka_options, acks="all", linger_ms=5)
        await producer.start()
        try:
            for i in range(200):
                await producer.send(topic, key=f"rollout-{i % 7}".encode(), value=f"{i}".encode())
            await producer.flush()
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(topic, **kafka_options, group_id=f"g-{uuid.uuid4().hex[:8]}",
                                    auto_offset_reset="earliest", enable_auto_commit=False,
                                    session_timeout_ms=3000, heartbeat_interval_ms=500)
        await consumer.start()
        received = []
        try:
            while len(received) < 200:
                batch = await asyncio.wait_for(consumer.getmany(timeout_ms=500), 30)
                for records in batch.values():
                    received.extend((r.key.decode(), int(r.value)) for r in records)
            await consumer.commit()
        finally:
            await consumer.stop()
        return received

    received = asyncio.run(go())
    assert sorted(v for _, v in received) == list(range(200))
    for key in {k for k, _ in received}:
        values = [v for k, v in received if k == key]
        assert values == sorted(values), "records of one key must stay in order (one partition per key)"


def test_confluent_kafka_reads_what_aiokafka_wrote_and_back(kafka_options, unique_prefix, stack_config, stack):
    topic = f"{unique_prefix}interop"
    asyncio.run(_create_topic(kafka_options, topic, partitions=2))

    async def produce():
        producer = AIOKafkaProducer(**kafka_options)
        await producer.start()
        try:
            for i in range(50):
                await producer.send_and_wait(topic, key=b"k", value=f"aiokafka-{i}".encode())
        finally:
            await producer.stop()

    asyncio.run(produce())
    conf = {"bootstrap.servers": stack.bootstrap_servers}
    # murmur2 is the Java client's (and aiokafka's) key partitioner; librdkafka's default differs.
    producer = Producer({**conf, "partitioner": "murmur2_random"})
    for i in range(50):
        producer.produce(topic, key=b"k", value=f"confluent-{i}".encode())
    assert producer.flush(10) == 0

    consumer = Consumer({**conf, "group.id": f"c-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest",
                         "session.timeout.ms": 6000})
    consumer.subscribe([topic])
    seen = []
    try:
        for _ in range(200):
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                seen.append(message.value().decode())
            if len(seen) == 100:
                break
    finally:
        consumer.close()
    assert seen == [f"aiokafka-{i}" for i in range(50)] + [f"confluent-{i}" for i in range(50)]

    listed = AdminClient(conf).list_topics(timeout=10).topics
    assert {f"{stack_config.topics.prefix}{role}" for role in PRODUCT_ROLES} <= set(listed)


def test_message_counts_use_the_true_high_watermark(kafka_options, unique_prefix):
    topic = f"{unique_prefix}counts"

    async def go():
        await _create_topic(kafka_options, topic, partitions=4)
        producer = AIOKafkaProducer(**kafka_options, linger_ms=20)
        await producer.start()
        try:
            for i in range(1000):
                await producer.send(topic, key=str(i).encode(), value=b"x" * 50)
            await producer.flush()
        finally:
            await producer.stop()
        return await message_counts(kafka_options, {topic: 4})

    assert asyncio.run(go()) == {topic: 1000}


def test_producers_are_idempotent_where_the_broker_grants_producer_ids(stack_config, kafka_options):
    """``[kafka] idempotence``: auto follows the broker (Apache Kafka grants producer ids, tansu 0.6 does not), on
    refuses a broker without them by name, off never asks; a producer from start_producer delivers either way."""
    from dataclasses import replace

    from agentstream.infra.kafka import IdempotenceUnsupported, idempotence_granted, start_producer
    from tests.conftest import TEST_BROKER

    topic = f"idempotence-{uuid.uuid4().hex[:8]}"

    async def check() -> tuple[bool, bool, bytes]:
        await _create_topic(kafka_options, topic, 1)
        auto = await idempotence_granted("auto", kafka_options)
        off = await idempotence_granted("off", kafka_options)
        if TEST_BROKER == "tansu":
            try:
                await idempotence_granted("on", kafka_options)
                raise AssertionError("idempotence = on was accepted by a broker that grants no producer id")
            except IdempotenceUnsupported as error:
                assert error.retriable is False and "grants no producer id" in str(error)
        producer = await start_producer(replace(stack_config.kafka, idempotence="auto"), kafka_options)
        try:
            await producer.send_and_wait(topic, b"once", key=b"k")
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(topic, **kafka_options, auto_offset_reset="earliest")
        await consumer.start()
        try:
            record = await asyncio.wait_for(consumer.getone(), 10)
        finally:
            await consumer.stop()
        return auto, off, record.value

    auto, off, value = asyncio.run(check())
    assert auto is (TEST_BROKER == "kafka")
    assert off is False
    assert value == b"once"

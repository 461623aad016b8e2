"""The Schema Registry with real parts: tansu holds its log, the official confluent-kafka SchemaRegistryClient and
AvroDeserializer and ClickHouse's own AvroConfluent format decode every product topic knowing nothing of
agentstream, and a user's own registry (a second server, sequential ids, already in use) gets agentstream's
schemas, its ids on the wire, and an incompatible change refused with a clear error.

The embedded ClickHouse (chdb) lists the Kafka table engine but cannot create a Kafka table ("Shutdown was
called"), so ClickHouse reads the topics' records as a Kafka engine would hand them over: raw values inserted
with ``FORMAT AvroConfluent`` and ``format_avro_schema_registry_url``.

Schema ids are the same in another process with another hash seed (a child process, so the test is here).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import struct
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.common.schema_registry_client import SchemaVersion
from confluent_kafka.serialization import MessageField, SerializationContext

from agentstream.infra.config import Config
from agentstream.infra.kafka import create_topics, topic_name
from agentstream.infra.processes import free_port
from agentstream.infra.registry_client import RegistryClient, RemoteRegistry, use_configured_registry
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.schemas import (
    ANNOUNCEMENT,
    CHECKPOINT,
    DEAD_LETTER,
    DEPLOYMENT,
    ROLLOUT_EVENT,
    SPAN,
    SPAN_BATCH,
    TASK,
    TRANSITION,
    TRANSITION_BATCH,
    AvroCodec,
    current_schemas,
    schema_id,
    use_registry,
)
from agentstream.schemas.catalog import schema_json
from tests.support.avro_samples import ROOT, SAMPLES, llm_span
from tests.support.schema_registry import RegistryProcess, register_users_subjects

# Which records each product topic carries.
TOPIC_RECORDS = {
    "tasks": [TASK],
    "spans": [SPAN_BATCH, SPAN, ROLLOUT_EVENT],
    "transitions": [TRANSITION_BATCH, TRANSITION],
    "checkpoints": [CHECKPOINT],
    "deployments": [DEPLOYMENT, ANNOUNCEMENT],
    "dlq": [DEAD_LETTER],
}
SPAN_TUPLE = ("Tuple(span_id String, rollout_id String, attempt_id String, parent_id Nullable(String), name String, "
              "kind String, start_time_us DateTime64(6, 'UTC'), end_time_us DateTime64(6, 'UTC'), status String, "
              "status_message Nullable(String), agent_name Nullable(String), task_id Nullable(String), "
              "group_id Nullable(String), model Nullable(String), attributes Map(String, String), "
              "prompt_token_ids Array(Int32), response_token_ids Array(Int32), response_logprobs Array(Float32), "
              "reward Nullable(Float64), reward_dimensions Map(String, Float64), policy_version Nullable(Int64))")


def produce(bootstrap: str, records: list[tuple[str, bytes]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    for topic, value in records:
        producer.produce(topic, value=value, key=b"k")
    assert producer.flush(15) == 0


def consume_all(bootstrap: str, topics: dict[str, int], expected: int, timeout_s: float = 20.0
                ) -> list[tuple[str, bytes]]:
    """Every value on ``topics`` (name -> partitions), read from the beginning without a group join."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"sr-{time.monotonic_ns()}",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 50})
    consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, count in topics.items() for p in range(count)])
    found: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(found) < expected and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is not None and message.error() is None:
                found.append((message.topic(), message.value()))
    finally:
        consumer.close()
    assert len(found) == expected
    return found


def plain(value: Any) -> Any:
    """AvroDeserializer's value with timestamps as the integer microseconds agentstream's codec reads."""
    if isinstance(value, dt.datetime):
        return round(value.timestamp() * 1_000_000)
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def partitions(config: Config) -> dict[str, int]:
    single = {"checkpoints", "deployments", "dlq"}
    return {topic_name(config.topics, role): 1 if role in single else config.topics.partitions
            for role in TOPIC_RECORDS}


def test_standard_tools_decode_every_topic(schema_registry: RegistryProcess, topics_config: Config, stack,
                                           clickhouse) -> None:
    import asyncio

    asyncio.run(create_topics(topics_config, stack.bootstrap_servers))
    codec = AvroCodec()
    written = [(topic_name(topics_config.topics, role), record, codec.encode(record, SAMPLES[record]))
               for role, records in TOPIC_RECORDS.items() for record in records]
    produce(stack.bootstrap_servers, [(topic, value) for topic, _, value in written])

    received = consume_all(stack.bootstrap_servers, partitions(topics_config), len(written))
    registry = SchemaRegistryClient({"url": schema_registry.url})
    deserialize = AvroDeserializer(registry)
    by_value = {value: (topic, record) for topic, record, value in written}
    for topic, value in received:
        _, record = by_value[value]
        decoded = deserialize(value, SerializationContext(topic, MessageField.VALUE))
        assert plain(decoded) == plain(codec.decode(value)[1]), record
        served = registry.get_schema(struct.unpack(">I", value[1:5])[0]).schema_str
        assert json.loads(served) == json.loads(schema_json(current_schemas()[record]))

    # ClickHouse's own AvroConfluent reader, with the registry's URL, over the values a Kafka engine would read.
    settings = {"format_avro_schema_registry_url": schema_registry.url}
    database = topics_config.clickhouse.database
    clickhouse.command(f"CREATE OR REPLACE TABLE {database}.sr_tasks (task_id String, rollout_id String, "
                       f"group_id Nullable(String), timeout_s Float64, enqueued_at_us DateTime64(6, 'UTC'), "
                       f"metadata Map(String, String)) ENGINE = MergeTree ORDER BY task_id")
    clickhouse.command(f"CREATE OR REPLACE TABLE {database}.sr_spans (spans Array({SPAN_TUPLE})) "
                       f"ENGINE = MergeTree ORDER BY tuple()")
    clickhouse.command(f"CREATE OR REPLACE TABLE {database}.sr_checkpoints (model String, version Int64, "
                       f"created_at_us DateTime64(6, 'UTC'), metrics Map(String, Float64), format String) "
                       f"ENGINE = MergeTree ORDER BY version")
    for table, record in (("sr_tasks", TASK), ("sr_spans", SPAN_BATCH), ("sr_checkpoints", CHECKPOINT)):
        values = b"".join(value for _, name, value in written if name == record)
        clickhouse.raw_insert(f"{database}.{table}", insert_block=values, settings=settings, fmt="AvroConfluent")
    task = SAMPLES[TASK]
    assert clickhouse.query(f"SELECT task_id, group_id, timeout_s, toUnixTimestamp64Micro(enqueued_at_us), "
                            f"metadata FROM {database}.sr_tasks").result_rows == [
        (task["task_id"], task["group_id"], task["timeout_s"], task["enqueued_at_us"], task["metadata"])]
    spans = SAMPLES[SPAN_BATCH]["spans"]
    assert clickhouse.query(f"SELECT s.span_id, s.kind, s.response_token_ids, s.reward, s.reward_dimensions "
                            f"FROM {database}.sr_spans ARRAY JOIN spans AS s").result_rows == [
        (s["span_id"], s["kind"], s["response_token_ids"] or [], s["reward"], s["reward_dimensions"] or {})
        for s in spans]
    checkpoint = SAMPLES[CHECKPOINT]
    assert clickhouse.query(f"SELECT model, version, metrics FROM {database}.sr_checkpoints").result_rows == [
        (checkpoint["model"], checkpoint["version"], checkpoint["metrics"])]


def test_the_registry_comes_back_from_its_topic(stack, tmp_path: Path) -> None:
    topic = f"_schemas.restart.{free_port()}"
    first = RegistryProcess(stack.bootstrap_servers, topic, tmp_path / "registry.log").start()
    try:
        client = SchemaRegistryClient({"url": first.url})
        mine = Schema('{"type": "record", "name": "Mine",  "fields": [{"name": "x", "type": "int"}]}', "AVRO")
        mine_id = client.register_schema("mine-value", mine)
        client.set_compatibility("mine-value", "FULL")
        client.update_mode("mine-value", "READONLY")
        gone = Schema(json.dumps({"type": "record", "name": "Gone", "fields": [{"name": "y", "type": "int"}]}))
        gone_id = client.register_schema("gone-value", gone)
        client.register_schema("soft-value", gone)
        assert client.delete_subject("gone-value") == [1] and client.delete_subject("soft-value") == [1]
        assert client.delete_subject("gone-value", permanent=True) == [1]
    finally:
        first.stop()
    second = RegistryProcess(stack.bootstrap_servers, topic, tmp_path / "registry.log", port=first.port).start()
    try:
        client = SchemaRegistryClient({"url": second.url})
        assert client.get_latest_version("mine-value").schema_id == mine_id
        assert client.get_schema(mine_id).schema_str == mine.schema_str  # as submitted
        assert client.get_compatibility("mine-value") == "FULL" and client.get_mode("mine-value") == "READONLY"
        subjects = set(client.get_subjects(deleted=True))
        assert "soft-value" in subjects and "gone-value" not in subjects
        assert "soft-value" not in client.get_subjects() and client.get_versions("soft-value", deleted=True) == [1]
        assert client.get_schema_versions(gone_id, deleted=True) == [SchemaVersion("soft-value", 1)]
        for name, schema in current_schemas().items():  # seeding again added no version
            retired = (name.endswith(("RolloutResult", "Transition", "TransitionBatch")))  # one in schemas/avro/history
            assert client.get_versions(name) == ([1, 2] if retired else [1])
            assert client.get_latest_version(name).schema_id == schema_id(schema)
    finally:
        second.stop()


@pytest.fixture
def users_registry(stack, tmp_path: Path):
    """The user's own registry: sequential ids, no agentstream schemas, three subjects of theirs already."""
    registry = RegistryProcess(stack.bootstrap_servers, f"_schemas.user.{free_port()}", tmp_path / "user.log",
                               ids="sequential", seed=False).start()
    register_users_subjects(registry.url)
    yield registry
    registry.stop()


def agentstream(*args: str, environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentstream", *args], capture_output=True, text=True,
                          env=environment, timeout=60, cwd=Path(__file__).resolve().parents[2])


def test_with_the_users_registry_its_ids_are_on_the_wire(users_registry: RegistryProcess, topics_config: Config,
                                                         stack, tmp_path: Path) -> None:
    environment = {**{k: v for k, v in os.environ.items() if not k.startswith(("AGENTSTREAM_", "SCHEMA_REGISTRY_"))},
                   "SCHEMA_REGISTRY_URL": users_registry.url, "AGENTSTREAM_HOME": str(tmp_path)}
    registered = agentstream("schema-registry", "register", environment=environment)
    assert registered.returncode == 0, registered.stderr
    ids = {line.split()[0]: int(line.split()[-1]) for line in registered.stdout.splitlines() if " id " in line}
    assert set(ids) == set(current_schemas()) and sorted(ids.values()) == list(range(4, 4 + len(ids)))

    import asyncio

    asyncio.run(create_topics(topics_config, stack.bootstrap_servers))
    config = replace(topics_config, schema_registry=replace(topics_config.schema_registry, url=users_registry.url))
    assert use_configured_registry(config) is not None  # what every agentstream command does with this config
    try:
        with SpanPublisher(config, stack.bootstrap_servers, journal_dir=tmp_path / "journal") as publisher:
            publisher.publish(llm_span(span_id="u1"))
            publisher.flush()
    finally:
        use_registry(None)
    spans_topic = topic_name(config.topics, "spans")
    ((_, value),) = consume_all(stack.bootstrap_servers, {spans_topic: config.topics.partitions}, 1)
    assert struct.unpack(">BI", value[:5]) == (0, ids[SPAN_BATCH])
    decoded = AvroDeserializer(SchemaRegistryClient({"url": users_registry.url}))(
        value, SerializationContext(spans_topic, MessageField.VALUE))
    assert [span["span_id"] for span in decoded["spans"]] == ["u1"]
    # A consumer of agentstream's (a streams worker, the sink) resolves that id through the registry too.
    fresh = AvroCodec(RemoteRegistry(RegistryClient(users_registry.url)))
    assert [span["span_id"] for span in fresh.decode(value)[1]["spans"]] == ["u1"]


def test_an_incompatible_schema_in_the_users_registry_is_refused_clearly(users_registry: RegistryProcess,
                                                                         tmp_path: Path) -> None:
    """The user's registry holds a Task version agentstream's Task cannot read: nothing is registered or used."""
    task = json.loads(schema_json(current_schemas()[TASK]))
    task["fields"] = [field for field in task["fields"] if field["name"] != "timeout_s"]
    RegistryClient(users_registry.url).register(TASK, json.dumps(task))
    environment = {**{k: v for k, v in os.environ.items() if not k.startswith(("AGENTSTREAM_", "SCHEMA_REGISTRY_"))},
                   "SCHEMA_REGISTRY_URL": users_registry.url, "AGENTSTREAM_HOME": str(tmp_path)}
    refused = agentstream("schema-registry", "register", environment=environment)
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: agentstream will not use its new schema of io.agentstream.v1.Task: "
                                     "it is not BACKWARD compatible with version 1"), refused.stderr
    assert "/fields/timeout_s: reader field is missing from the writer and has no default" in refused.stderr
    assert RegistryClient(users_registry.url).call("GET", f"/subjects/{TASK}/versions") == [1]


def test_the_stack_serves_the_registry(stack_config: Config, stack) -> None:
    """`agentstream up` (the session's stack) started a registry over its broker; status reports it."""
    from agentstream.stack.control import Stack

    url = f"http://{stack_config.stack.host}:{stack_config.schema_registry.port}"
    assert set(current_schemas()) <= set(SchemaRegistryClient({"url": url}).get_subjects())
    state = Stack(stack_config).status().services["schema-registry"]
    assert "running" in state and "subjects" in state


def test_ids_are_stable_across_processes() -> None:
    program = (
        "import json, schemas\n"
        "print(json.dumps({n: schemas.schema_id(s) for n, s in schemas.current_schemas().items()}))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4242", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout) == {name: schema_id(schema) for name, schema in current_schemas().items()}

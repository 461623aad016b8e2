"""Each role on a secured Apache Kafka: SASL_SSL (SCRAM-SHA-512, and PLAIN), the ACLs of infra/acls.py and no more.

One node serves the whole module (tests/support/kafka_secure.py). For each role, one test does its job
through the product's own clients with its own credentials, and one tries what the role must not and
gets a named error with ``retriable = False`` in bounded time. A wrong password: the same.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from agentstream.deploy.checkpoint_follower import CheckpointFollower
from agentstream.deploy.deployments import DeploymentFollower, announce
from agentstream.infra.acls import RUNNER_GROUP, TRAINER_GROUP_PREFIX, Grant, kafka_acls_commands, role_grants
from agentstream.infra.clickhouse import connect
from agentstream.infra.config import Config, load_config
from agentstream.infra.kafka import (
    KafkaAccessDenied,
    KafkaAuthenticationFailed,
    KafkaRefused,
    client_options,
    consumer_options,
    ensure_topics,
    named_refusals,
    product_topics,
    topic_name,
)
from agentstream.pipeline.collector.receiver import KafkaDeadLetters
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.schemas import AvroCodec
from agentstream.stack.control import Endpoints
from agentstream.streams.app import internal_topics
from agentstream.trainer.checkpoint_writer import CheckpointAnnouncer
from tests.support.kafka_secure import SecureKafka
from tests.support.streams_harness import CliProcess, Worker, wait_for, worker_env

pytestmark = pytest.mark.own_broker  # the worker tests use the session stack's ClickHouse, not its broker

PREFIX = "sec."
BOUND_S = 15.0
"""The longest a refusal may take to surface (each one measured here is under a second)."""
WORKER_BOUND_S = 60.0
"""The longest a refused `agentstream streams` process may run before it exits (it waits for ClickHouse first)."""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Config:
    home = tmp_path_factory.mktemp("secure-home")
    return load_config(environ={"AGENTSTREAM_HOME": str(home), "AGENTSTREAM_TOPIC_PREFIX": PREFIX})


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory, base: Config) -> Iterator[SecureKafka]:
    """The secured node with the product topics (made by the admin side) and every role's ACLs granted."""
    node = SecureKafka(tmp_path_factory.mktemp("secure-kafka")).start()
    try:
        asyncio.run(_create_topics(node.plaintext, base))
        for role, grants in role_grants(base).items():
            node.grant(role, grants)
        yield node
    finally:
        node.stop()


async def _create_topics(bootstrap: str, config: Config) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await ensure_topics(admin, product_topics(config.topics) + internal_topics(config))
    finally:
        await admin.close()


def publisher(config: Config, bootstrap: str, journal: Path) -> SpanPublisher:
    return SpanPublisher(config, bootstrap, journal_dir=journal, linger_ms=5, request_timeout_ms=5000,
                         probe_interval_s=0.2, exit_timeout_s=2)


def span(rollout_id: str, index: int) -> dict:
    return {"span_id": f"{rollout_id}-{index}", "rollout_id": rollout_id, "attempt_id": "a1", "name": "chat",
            "kind": "LLM", "start_time_us": 1_700_000_000_000_000 + index, "end_time_us": 1_700_000_000_000_100 + index,
            "status": "OK", "agent_name": "secure-agent", "attributes": {}}


def read_all(bootstrap: str, topic: str, at_least: int, timeout_s: float = 20.0) -> list[tuple[bytes | None, bytes]]:
    """Every record of ``topic`` from the admin side, once ``at_least`` are in."""

    async def read() -> list[tuple[bytes | None, bytes]]:
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                    enable_auto_commit=False)
        await consumer.start()
        found: list[tuple[bytes | None, bytes]] = []
        try:
            deadline = time.monotonic() + timeout_s
            while len(found) < at_least and time.monotonic() < deadline:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    found += [(r.key, r.value) for r in records]
        finally:
            await consumer.stop()
        return found

    return asyncio.run(read())


def refused_within(kind: type[KafkaRefused], call, *args) -> KafkaRefused:
    """Run ``call(*args)`` (a coroutine function or a plain one); it must raise ``kind``, not retriable, in time."""
    started = time.monotonic()
    with pytest.raises(kind) as caught:
        if asyncio.iscoroutinefunction(call):
            asyncio.run(asyncio.wait_for(call(*args), BOUND_S))
        else:
            call(*args)
    assert time.monotonic() - started < BOUND_S
    assert caught.value.retriable is False and type(caught.value).retriable is False
    assert "\n" not in str(caught.value)
    return caught.value


# --- the producers of spans: runner, proxy (PLAIN too), collector ---------------------------------------------

@pytest.mark.parametrize("role, mechanism", [("runner", "SCRAM-SHA-512"), ("proxy", "PLAIN"),
                                             ("collector", "SCRAM-SHA-512")])
def test_span_writers_publish_spans(kafka: SecureKafka, base: Config, tmp_path: Path, role: str,
                                    mechanism: str) -> None:
    config = kafka.config(base, role, mechanism=mechanism)
    rollout = f"rollout-{role}"
    with publisher(config, kafka.secure, tmp_path / "journal") as spans:
        for index in range(20):
            spans.publish(span(rollout, index))
        spans.flush(timeout_s=20)
        stats = spans.stats()
    assert (stats.spans_published, stats.spans_journaled, stats.records_dropped) == (20, 0, 0)
    landed = [value for key, value in read_all(kafka.plaintext, topic_name(base.topics, "spans"), 1)
              if key == rollout.encode()]
    codec = AvroCodec()
    assert sum(len(codec.decode(value)[1]["spans"]) for value in landed) == 20


def test_a_principal_without_write_on_spans_is_refused_and_journals(kafka: SecureKafka, base: Config,
                                                                    tmp_path: Path) -> None:
    """hotswap may not write spans: the publisher raises KafkaAccessDenied, keeps the spans in its journal, and
    refuses more; it does not take the refusal for an outage (journal and probe forever)."""
    config = kafka.config(base, "hotswap")
    spans = publisher(config, kafka.secure, tmp_path / "journal").start()
    try:
        spans.publish(span("rollout-refused", 0))
        error = refused_within(KafkaAccessDenied, spans.flush, BOUND_S)
        assert "User:hotswap" in str(error) and f"topic {PREFIX}spans" in str(error)
        with pytest.raises(KafkaAccessDenied):
            spans.publish(span("rollout-refused", 1))
        stats = spans.stats()
        assert (stats.spans_published, stats.spans_journaled, stats.records_dropped) == (0, 1, 0)
    finally:
        spans.close()


def test_runner_reads_tasks_in_its_group_only(kafka: SecureKafka, base: Config) -> None:
    """The runner's consumer (as pipeline/runner/pool.py makes it) joins its group; another group is refused."""
    options = consumer_options(kafka.config(base, "runner").kafka, kafka.secure)

    async def join(group: str) -> None:
        consumer = AIOKafkaConsumer(topic_name(base.topics, "tasks"), **options, group_id=group,
                                    enable_auto_commit=False, session_timeout_ms=3000, heartbeat_interval_ms=500)
        async with named_refusals(options, f"reading tasks in group {group}"):
            await consumer.start()
            try:
                await consumer.getmany(timeout_ms=500)
                assert consumer.assignment()
            finally:
                await consumer.stop()

    asyncio.run(join(RUNNER_GROUP))
    error = refused_within(KafkaAccessDenied, join, "agentstream-streams")
    assert "group agentstream-streams" in str(error) and "User:runner" in str(error)


def test_runner_may_not_announce_checkpoints(kafka: SecureKafka, base: Config) -> None:
    config = kafka.config(base, "runner")

    async def announce_checkpoint() -> None:
        announcer = CheckpointAnnouncer(config, kafka.secure)
        async with named_refusals(client_options(config.kafka, kafka.secure), "announcing a checkpoint"):
            await announcer.start()
            try:
                await announcer._producer.send_and_wait(announcer.topic, b"not a checkpoint", key=b"m")
            finally:
                await announcer.stop()

    error = refused_within(KafkaAccessDenied, announce_checkpoint)
    assert f"topic {PREFIX}checkpoints" in str(error)


def test_collector_writes_dead_letters_but_may_not_follow_deployments(kafka: SecureKafka, base: Config) -> None:
    """The collector's dead-letter producer writes dlq; a deployments follower with its credentials stops with
    KafkaAccessDenied instead of retrying every second (as it does while a broker is away)."""
    config = kafka.config(base, "collector")

    async def dead_letter() -> None:
        letters = KafkaDeadLetters(config.kafka, client_options(config.kafka, kafka.secure),
                                   topic_name(base.topics, "dlq"))
        await letters.start()
        assert letters.producer is not None
        await letters.send(b"collector dead letter")
        await letters.stop()

    asyncio.run(dead_letter())
    assert (None, b"collector dead letter") in read_all(kafka.plaintext, topic_name(base.topics, "dlq"), 1)
    follower = DeploymentFollower(config, kafka.secure, retry_s=0.1)
    error = refused_within(KafkaAccessDenied, follower.run, asyncio.Event())
    assert f"topic {PREFIX}deployments" in str(error) and "User:collector" in str(error)


# --- wrong credentials -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_wrong_password_is_named_not_an_outage(kafka: SecureKafka, base: Config, tmp_path: Path,
                                               mechanism: str) -> None:
    """aiokafka answers a refused login with KafkaConnectionError, like a broker that is down: the publisher
    must not journal and probe forever, and a follower must not retry forever."""
    config = kafka.config(base, "runner", mechanism=mechanism, password="not-the-password")
    error = refused_within(KafkaAuthenticationFailed, publisher(config, kafka.secure, tmp_path / "j").start)
    assert "User:runner" in str(error) and mechanism in str(error)
    refused_within(KafkaAuthenticationFailed, DeploymentFollower(kafka.config(
        base, "proxy", mechanism=mechanism, password="wrong"), kafka.secure, retry_s=0.1).run, asyncio.Event())


# --- trainer and hot swap -----------------------------------------------------------------------------------------

def test_trainer_reads_transitions_and_announces_checkpoints(kafka: SecureKafka, base: Config) -> None:
    config = kafka.config(base, "trainer")
    options = consumer_options(config.kafka, kafka.secure)

    async def train() -> None:
        consumer = AIOKafkaConsumer(topic_name(base.topics, "transitions"), **options,
                                    group_id=f"{TRAINER_GROUP_PREFIX}secure", enable_auto_commit=False,
                                    auto_offset_reset="earliest", session_timeout_ms=3000, heartbeat_interval_ms=500)
        announcer = CheckpointAnnouncer(config, kafka.secure)
        await consumer.start()
        await announcer.start()
        try:
            await consumer.getmany(timeout_ms=500)
            await consumer.commit()  # commits in its own group: allowed
            await announcer._producer.send_and_wait(announcer.topic, b"checkpoint event", key=b"secure-model")
        finally:
            await announcer.stop()
            await consumer.stop()

    asyncio.run(train())
    checkpoints = read_all(kafka.plaintext, topic_name(base.topics, "checkpoints"), 1)
    assert (b"secure-model", b"checkpoint event") in checkpoints


def test_trainer_may_not_read_checkpoints(kafka: SecureKafka, base: Config) -> None:
    config = kafka.config(base, "trainer")
    follower = CheckpointFollower(config, kafka.secure, "secure-model")

    async def follow() -> None:
        try:
            await follower.start()
            await follower.catch_up(timeout_ms=500)
        finally:
            await follower.stop()

    error = refused_within(KafkaAccessDenied, follow)
    assert f"topic {PREFIX}checkpoints" in str(error) and "User:trainer" in str(error)


def test_hotswap_reads_checkpoints_and_writes_deployments(kafka: SecureKafka, base: Config) -> None:
    """hot swap's (and the gate's) Kafka side: the checkpoint follower, its announcement on deployments, the
    deployments follower that reads it back."""
    config = kafka.config(base, "hotswap")

    async def swap() -> None:
        checkpoints = CheckpointFollower(config, kafka.secure, "secure-model")
        await checkpoints.start()
        try:
            await checkpoints.catch_up(timeout_ms=1000)
        finally:
            await checkpoints.stop()
        stop = asyncio.Event()
        renewing = await announce(config, kafka.secure, "secure-model", "hotswap", gated=False, stop=stop)
        follower = DeploymentFollower(config, kafka.secure)
        following = asyncio.create_task(follower.run(stop))
        await asyncio.wait_for(follower.until_ready(following), 20)
        assert any(said.model == "secure-model" for said in follower.announcements.values())
        stop.set()
        await following
        await renewing

    asyncio.run(swap())


def test_hotswap_may_not_write_checkpoints(kafka: SecureKafka, base: Config) -> None:
    config = kafka.config(base, "hotswap")

    async def write() -> None:
        announcer = CheckpointAnnouncer(config, kafka.secure)
        async with named_refusals(client_options(config.kafka, kafka.secure), "announcing a checkpoint"):
            await announcer.start()
            try:
                await announcer._producer.send_and_wait(announcer.topic, b"forged", key=b"secure-model")
            finally:
                await announcer.stop()

    refused_within(KafkaAccessDenied, write)


# --- the stream worker (faust), as a process -------------------------------------------------------------------

@pytest.fixture
def database(stack: Endpoints, stack_config: Config) -> Iterator[str]:
    """A ClickHouse database of the session stack for one worker, dropped afterwards."""
    name = f"secure_{uuid.uuid4().hex[:8]}"
    yield name
    clickhouse = connect(stack_config.clickhouse, stack.clickhouse_url)
    clickhouse.command(f"DROP DATABASE IF EXISTS {name}")
    clickhouse.close()


WORKER_CONFIG = """
[[credit]]
agent = "grpo-*"
strategy = "grpo"
group_size = 2
group_timeout_s = 5

[[credit]]
agent = "*"
strategy = "final"
"""
"""GRPO groups make the worker write and read its streams.groups topic; everything else gets the final reward."""


def secure_worker_env(kafka: SecureKafka, stack: Endpoints, tmp_path: Path, database: str, user: str,
                      password: str | None = None) -> dict:
    """`agentstream streams`' environment: the session stack's ClickHouse (``database``), the secured node as
    ``user`` over SASL_SSL/SCRAM-SHA-512 (its own password unless ``password``), the module's topic prefix."""
    env = worker_env(tmp_path, stack, PREFIX, database, WORKER_CONFIG)
    env.update({"KAFKA_BOOTSTRAP_SERVERS": kafka.secure, "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "KAFKA_SASL_USERNAME": user,
                "KAFKA_SASL_PASSWORD": password or kafka.passwords[user], "KAFKA_SSL_CAFILE": str(kafka.tls.ca)})
    return env


def publish_rollout(spans: SpanPublisher, rollout_id: str, agent: str, reward: float, group: str | None = None) -> None:
    """One finished rollout as a runner publishes it: STARTED, an LLM call with token ids, a reward, SUCCEEDED."""
    now = time.time_ns() // 1000
    common = {"rollout_id": rollout_id, "attempt_id": f"{rollout_id}-1", "agent_name": agent, "group_id": group,
              "attributes": {}}
    event = {"rollout_id": rollout_id, "attempt_id": f"{rollout_id}-1", "agent_name": agent}
    spans.publish_event({**event, "event": "STARTED", "at_us": now})
    spans.publish({**common, "span_id": f"{rollout_id}-llm", "name": "chat", "kind": "LLM", "start_time_us": now,
                   "end_time_us": now + 10, "status": "OK", "model": "secure-model", "policy_version": 1,
                   "prompt_token_ids": [1, 2, 3], "response_token_ids": [7, 8], "response_logprobs": [-0.5, -0.25]})
    spans.publish({**common, "span_id": f"{rollout_id}-reward", "name": "reward", "kind": "REWARD",
                   "start_time_us": now + 20, "end_time_us": now + 20, "status": "OK", "reward": reward})
    spans.publish_event({**event, "event": "SUCCEEDED", "at_us": now + 30})


def test_worker_stores_spans_and_writes_transitions(kafka: SecureKafka, base: Config, stack: Endpoints,
                                                    stack_config: Config, database: str, tmp_path: Path) -> None:
    """A real `agentstream streams` process as ``worker`` (the ACLs of role_grants only) stores what a runner
    published in ClickHouse and writes its transitions: through streams.groups for a GRPO group, and an undecodable
    record to dlq. Every one of its grants is used."""
    worker = Worker(secure_worker_env(kafka, stack, tmp_path, database, "worker"), tmp_path / "worker.log")
    clickhouse = connect(stack_config.clickhouse, stack.clickhouse_url)
    runner = kafka.config(base, "runner")
    try:
        worker.start()
        with publisher(runner, kafka.secure, tmp_path / "journal") as spans:
            publish_rollout(spans, "secure-r1", "secure-agent", 1.0)
            for index, reward in enumerate([0.0, 1.0]):
                publish_rollout(spans, f"secure-g{index}", "grpo-secure", reward, group="secure-group")
            spans.flush(timeout_s=20)
        asyncio.run(produce_raw(client_options(runner.kafka, kafka.secure), topic_name(base.topics, "spans"),
                                b"secure-garbage", b"\x07not avro"))

        def stored() -> int:
            return int(clickhouse.query(f"SELECT count() FROM {database}.spans WHERE rollout_id LIKE 'secure-%'")
                       .result_rows[0][0])

        wait_for(stored, 60, what="spans in ClickHouse", equals=6)
        codec = AvroCodec()

        def transitions() -> list[str]:
            batches = [codec.decode(value)[1] for key, value in read_all(
                kafka.plaintext, topic_name(base.topics, "transitions"), 1, timeout_s=2) if key == b"secure-model"]
            return sorted(item["rollout_id"] for batch in batches for item in batch["transitions"])

        wait_for(transitions, 30, what="transitions", equals=["secure-g0", "secure-g1", "secure-r1"])
        wait_for(lambda: any(key == b"secure-garbage"
                             for key, _ in read_all(kafka.plaintext, topic_name(base.topics, "dlq"), 1)),
                 30, what="the undecodable record in dlq", equals=True)
    finally:
        worker.stop()
        clickhouse.close()


async def produce_raw(options: dict, topic: str, key: bytes, value: bytes) -> None:
    """One record as it is, with a role's credentials (``options``)."""
    producer = AIOKafkaProducer(**options, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


def refused_worker(env: dict, log_path: Path) -> tuple[str, str]:
    """Run `agentstream streams` until it exits (within WORKER_BOUND_S): status 1, and its last line, the only
    `error:` line, says why. Returns that line and the whole log."""
    worker = CliProcess(["streams"], env, log_path)
    worker.start()
    code = worker.exit_code(WORKER_BOUND_S)
    log = worker.log()
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 1 and errors == lines[-1:], log[-3000:]
    return errors[0], log


def test_worker_with_runner_credentials_exits_naming_the_refusal(kafka: SecureKafka, stack: Endpoints,
                                                                 database: str, tmp_path: Path) -> None:
    """The runner may not read spans in the streams group: the worker says so before faust starts (faust waited
    forever: aiokafka keeps the group's refusal for a getmany faust never calls)."""
    line, log = refused_worker(secure_worker_env(kafka, stack, tmp_path, database, "runner"), tmp_path / "worker.log")
    assert line.startswith("error: KafkaAccessDenied: ") and "User:runner" in line, line
    assert "group agentstream-streams" in line and "Traceback" not in log, line


def test_worker_refused_reading_after_it_joined_exits_naming_the_topic(kafka: SecureKafka, base: Config,
                                                                       stack: Endpoints, database: str,
                                                                       tmp_path: Path) -> None:
    """hotswap, granted what the up-front check sees (Describe on the worker's topics, Read on its group) but no Read
    on a topic: faust joins, its first fetch is refused and it crashes; the worker's last line names the refusal."""
    grants = [Grant("topic", f"{PREFIX}{name}", "describe") for name in ("spans", "streams.groups", "transitions",
                                                                          "dlq")]
    grants.append(Grant("group", base.streams.app_id, "read"))
    kafka.grant("hotswap", grants)
    try:
        line, _ = refused_worker(secure_worker_env(kafka, stack, tmp_path, database, "hotswap"),
                                 tmp_path / "worker.log")
    finally:
        kafka.revoke("hotswap", grants)
    assert line.startswith("error: KafkaAccessDenied: ") and "User:hotswap" in line and f"topic {PREFIX}" in line


def test_worker_with_a_wrong_password_exits_naming_the_login(kafka: SecureKafka, stack: Endpoints,
                                                             database: str, tmp_path: Path) -> None:
    """A refused login: named before faust starts (the first admin call raised a bare 'Unable to bootstrap')."""
    line, log = refused_worker(secure_worker_env(kafka, stack, tmp_path, database, "worker",
                                                 password="not-the-password"), tmp_path / "worker.log")
    assert line.startswith("error: KafkaAuthenticationFailed: ") and "User:worker" in line, line
    assert "Traceback" not in log


def test_kafka_acls_commands_name_every_grant(base: Config) -> None:
    lines = kafka_acls_commands(base, "broker:9093", command_config="admin.properties")
    assert len(lines) == sum(len(grants) for grants in role_grants(base).values())
    assert ("kafka-acls.sh --bootstrap-server broker:9093 --command-config admin.properties --add "
            f"--allow-principal User:runner --operation Write --topic {PREFIX}spans") in lines
    assert any("--group agentstream-trainer- --resource-pattern-type prefixed" in line for line in lines)

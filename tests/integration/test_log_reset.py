"""A log that loses its head (a broker on memory:// restarted, a wiped or recreated topic) is read again from its
start by every consumer, with one clear line, instead of being skipped silently from the old positions.

Measured before the fix: a worker resumed at its old offsets after a broker restart and 4,014 spans never
reached ClickHouse, with no error anywhere. Each test here runs its own in-memory tansu, kills and restarts it.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import load_config
from agentstream.infra.kafka import create_topics, topic_name
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.runner.pool import Runner, RunnerOptions
from agentstream.pipeline.runner.tasks import enqueue, make_task
from agentstream.trainer.checkpoint_writer import manifests, open_store
from tests.integration.test_trainer_worker import produce as produce_transitions
from tests.integration.test_trainer_worker import transition
from tests.support.broker import MemoryBroker
from tests.support.streams_harness import CliProcess, Worker, produce, rollout_records, wait_for, worker_env
from tests.support.trainer_configs import tiny_trainer_toml

CONFIG = """
[streams]
app_id = "{app_id}"
grace_s = 0.2
idle_timeout_s = 1.5
session_timeout_s = 3
shutdown_grace_s = 5

[[credit]]
agent = "*"
strategy = "final"
"""


@pytest.fixture
def broker(tmp_path):
    running = MemoryBroker(tmp_path).start()
    yield running
    running.kill()


def _rollouts(prefix: str, count: int) -> list[tuple[bytes, bytes]]:
    items = []
    for index in range(count):
        rollout_id = f"{prefix}-{index}"
        items.extend((rollout_id.encode(), value) for value in rollout_records(
            rollout_id, agent="math", llm_at=[0, 1000], rewards=[(2000, 1.0)]))
    return items


def test_the_stream_worker_reads_a_restarted_brokers_new_log_from_its_start(tmp_path, stack, stack_config, broker):
    tag = uuid.uuid4().hex[:8]
    database = f"reset_{tag}"
    env = worker_env(tmp_path, stack, f"r{tag}.", database, CONFIG.format(app_id=f"reset-{tag}"))
    env["KAFKA_BOOTSTRAP_SERVERS"] = broker.bootstrap_servers
    config = load_config(environ=env)
    asyncio.run(create_topics(config, broker.bootstrap_servers))
    spans_topic, group = topic_name(config.topics, "spans"), f"reset-{tag}"
    client = connect(stack_config.clickhouse, stack.clickhouse_url)
    worker = Worker(env, tmp_path / "worker.log").start()

    def stored(prefix: str) -> int:
        return client.query(f"SELECT count() FROM {database}.spans FINAL WHERE rollout_id LIKE '{prefix}-%'"
                            ).result_rows[0][0]

    try:
        asyncio.run(produce(broker.bootstrap_servers, spans_topic, _rollouts("before", 80)))  # 240 records
        wait_for(lambda: stored("before"), 60, what="the first log stored", equals=240, process=worker)
        time.sleep(1.5)  # several commit intervals: the group's offsets are ~60 per partition
        positions = asyncio.run(_committed(broker.bootstrap_servers, group, spans_topic))
        # Under load a worker can commit what it acknowledged during the outage as soon as the new broker answers
        # (tansu accepts a commit from a client that is no member), before it rejoins and seeks to the committed
        # offsets: here those old offsets are committed for it, so the test does not depend on that race. The
        # worker is paused meanwhile: once it has rejoined, tansu refuses a non-member's commit (UnknownMemberId).
        worker.process.send_signal(signal.SIGSTOP)
        try:
            broker.restart()  # memory://: every topic starts again at offset 0, and the group's offsets are gone
            asyncio.run(create_topics(config, broker.bootstrap_servers))
            asyncio.run(_commit(broker.bootstrap_servers, group, positions))
        finally:
            worker.process.send_signal(signal.SIGCONT)
        asyncio.run(produce(broker.bootstrap_servers, spans_topic, _rollouts("after", 20)))  # ~15 per partition
        wait_for(lambda: stored("after"), 45, what="every span of the new log stored", equals=60,
                 process=worker)
        resets = [line for line in worker.log().splitlines() if "log reset on" in line]
        print("\n".join(resets))
        assert resets and all("policy: reprocess" in line for line in resets)
        assert worker.process.poll() is None
    finally:
        worker.stop()
        client.command(f"DROP DATABASE IF EXISTS {database}")
        client.close()


async def _committed(bootstrap: str, group: str, topic: str) -> dict[TopicPartition, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        found = {tp: await consumer.committed(tp) for tp in (TopicPartition(topic, p) for p in range(4))}
        return {tp: offset for tp, offset in found.items() if offset}
    finally:
        await consumer.stop()


async def _commit(bootstrap: str, group: str, positions: dict[TopicPartition, int]) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(list(positions))
        await consumer.commit(positions)
    finally:
        await consumer.stop()


def test_a_runner_runs_the_tasks_of_a_restarted_brokers_new_log(tmp_path, broker, caplog):
    config = load_config(environ={"AGENTSTREAM_HOME": str(tmp_path / "home"),
                                  "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap_servers,
                                  "AGENTSTREAM_TOPIC_PREFIX": f"r{uuid.uuid4().hex[:8]}."})
    tasks_topic = topic_name(config.topics, "tasks")
    seen: list[int] = []

    def agent(task: dict) -> float:
        seen.append(task["n"])
        return 1.0

    async def scenario() -> None:
        await create_topics(config, broker.bootstrap_servers)
        await enqueue(config, broker.bootstrap_servers, [_task(n) for n in range(40)])
        with SpanPublisher(config, broker.bootstrap_servers, journal_dir=tmp_path / "journal") as publisher:
            runner = Runner(agent, config, broker.bootstrap_servers, publisher,
                            RunnerOptions(concurrency=4, group_id="reset-runners", session_timeout_ms=3000))
            stop = asyncio.Event()
            running = asyncio.create_task(runner.run(stop))
            await _until(lambda: len(seen) >= 40, 60)
            await asyncio.sleep(1.0)  # committed: ~10 per partition
            positions = await _committed(broker.bootstrap_servers, "reset-runners", tasks_topic)
            broker.restart()
            await create_topics(config, broker.bootstrap_servers)
            await _commit(broker.bootstrap_servers, "reset-runners", positions)  # as in the stream worker's test
            # The new log stays empty until every old position was noticed past its end: a log that grows back to
            # the old position before the runner looks cannot be told from the old one by offsets alone.
            await _until(lambda: {f"{tp.topic}[{tp.partition}]" for tp in positions} <= _reset_partitions(caplog), 45)
            await enqueue(config, broker.bootstrap_servers, [_task(n) for n in range(100, 108)])  # ~2 per partition
            await _until(lambda: set(range(100, 108)) <= set(seen), 45)
            stop.set()
            await asyncio.wait_for(running, 30)

    asyncio.run(scenario())
    assert sorted(n for n in seen if n >= 100) == list(range(100, 108))
    resets = [r.getMessage() for r in caplog.records if r.name == "agentstream.logreset"]
    print("\n".join(resets))
    assert resets and all("runner was at offset" in line and "policy: reprocess" in line for line in resets)


def _reset_partitions(caplog) -> set[str]:
    """The ``topic[partition]`` of every log reset reported so far."""
    return {r.getMessage().split()[3].rstrip(":") for r in caplog.records if r.name == "agentstream.logreset"}


def _task(n: int) -> dict:
    return make_task({"n": n}, agent_name="counter", max_attempts=1, timeout_s=30)


async def _until(check, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)



def test_the_trainer_reads_a_restarted_brokers_new_log_and_trains_no_transition_twice(tmp_path, stack, broker):
    model = f"tiny-reset-{uuid.uuid4().hex[:6]}"
    checkpoints = tmp_path / "checkpoints"
    env = worker_env(tmp_path, stack, f"r{uuid.uuid4().hex[:8]}.", f"reset_{uuid.uuid4().hex[:8]}",
                     tiny_trainer_toml(model, checkpoints, checkpoint_every_steps=1))
    env["KAFKA_BOOTSTRAP_SERVERS"] = broker.bootstrap_servers
    config = load_config(environ=env)
    options = {"bootstrap_servers": broker.bootstrap_servers}
    topic = topic_name(config.topics, "transitions")
    old = [transition(f"t{i:02d}", model, advantage=(-1.0) ** i) for i in range(12)]
    new = [transition(f"n{i:02d}", model, advantage=(-1.0) ** i) for i in range(4)]
    asyncio.run(create_topics(config, broker.bootstrap_servers))
    trainer = CliProcess(["train-worker"], env, tmp_path / "trainer.log").start()
    try:
        asyncio.run(produce_transitions(options, topic, old))  # one partition (keyed by model), offsets 0-11
        trainer.wait_for("checkpoint v3", 90)
        broker.restart()
        asyncio.run(create_topics(config, broker.bootstrap_servers))
        # the new log: four transitions already trained (a replay upstream), then four new ones; offsets 0-7 < 12
        asyncio.run(produce_transitions(options, topic, old[:4] + new))
        trainer.wait_for("checkpoint v4", 120)  # about 15 s here; 60 s ran out once in CI
        resets = [line for line in trainer.log().splitlines() if "log reset on" in line]
        print("\n".join(resets))
        assert resets
    finally:
        trainer.stop()
    trained = [transition_id for m in manifests(open_store(str(checkpoints)), model) for transition_id in m.trained_ids]
    assert len(trained) == len(set(trained)) == 16, "each transition trained once, the replayed ones not again"

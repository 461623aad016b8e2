"""The trainer on the real broker and ClickHouse: consume, dedupe, staleness, checkpoints, commits, restart, crash."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import pytest
import torch
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from agentstream.deploy.deployments import Action, DeploymentLog, Routing, decide
from agentstream.deploy.rebase import RejectionStreak
from agentstream.infra.config import Config, TrainerConfig
from agentstream.infra.kafka import create_topics, topic_name
from agentstream.models.weights import ADAPTER_WEIGHTS_FILE
from agentstream.schemas import CHECKPOINT, TRANSITION, TRANSITION_BATCH, AvroCodec
from agentstream.trainer.checkpoint_writer import manifests, open_store
from agentstream.trainer.errors import TrainerConfigError
from agentstream.trainer.metrics import MetricsWriter
from agentstream.trainer.worker import TrainerWorker
from tests.support.streams_harness import CliProcess, worker_env
from tests.support.trainer_configs import tiny_trainer_toml

CODEC = AvroCodec()


def transition(transition_id: str, model: str, *, version: int = 0, advantage: float = 1.0,
               reward: float = 1.0) -> dict:
    """A Transition record with a short prompt and response (behaviour logprobs need not be the model's here)."""
    seed = sum(map(ord, transition_id))
    return {"transition_id": transition_id, "rollout_id": f"r-{transition_id}", "span_id": f"s-{transition_id}",
            "agent_name": "agent", "model": model, "policy_version": version, "step_index": 0,
            "prompt_token_ids": [60 + seed % 50, 61, 62, 63], "response_token_ids": [70 + seed % 40, 71],
            "behaviour_logprobs": [-5.0, -5.5], "reward": reward, "return_value": reward, "advantage": advantage,
            "group_id": None, "created_at_us": time.time_ns() // 1000}


async def produce(options: dict, topic: str, records: list[dict], *, as_batch: bool = False) -> None:
    """Transition records, or one TransitionBatch record holding them all (as the streams processors publish)."""
    producer = AIOKafkaProducer(**options, acks="all", linger_ms=5)
    await producer.start()
    try:
        if as_batch:
            await producer.send(topic, key=records[0]["model"].encode(),
                                value=CODEC.encode(TRANSITION_BATCH, {"transitions": records}))
        for record in records if not as_batch else []:
            await producer.send(topic, key=record["model"].encode(), value=CODEC.encode(TRANSITION, record))
        await producer.flush()
    finally:
        await producer.stop()


async def checkpoint_events(options: dict, config: Config) -> list[tuple[str, dict]]:
    topic = topic_name(config.topics, "checkpoints")
    consumer = AIOKafkaConsumer(topic, **options, group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    events = []
    try:
        while batch := await consumer.getmany(timeout_ms=1000):
            for records in batch.values():
                events += [(r.key.decode(), CODEC.decode(r.value, CHECKPOINT)[1]) for r in records]
    finally:
        await consumer.stop()
    return events


async def until(check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.fixture
def trainer_setup(topics_config, tmp_path, stack):
    model = f"tiny-{uuid.uuid4().hex[:8]}"
    trainer = TrainerConfig(model="tiny", model_name=model, device="cpu", threads=1, lr=1e-3, batch_transitions=4,
                            batch_tokens=0, batch_wait_s=60, max_policy_lag=0, checkpoint_dir=str(tmp_path / "ckpt"),
                            session_timeout_s=3)
    config = replace(topics_config, trainer=trainer, stack=replace(topics_config.stack, home=tmp_path))
    asyncio.run(create_topics(config, stack.bootstrap_servers))
    return config, model


def test_trains_from_kafka_drops_duplicates_and_stale_commits_after_checkpoints_and_resumes(
        trainer_setup, stack, kafka_options, clickhouse, stack_config):
    config, model = trainer_setup
    config = replace(config, trainer=replace(config.trainer, optimizer_state_every=2))
    database = stack_config.clickhouse.database
    topic = topic_name(config.topics, "transitions")
    lines: list[str] = []

    def worker() -> TrainerWorker:
        return TrainerWorker(config, stack.bootstrap_servers, metrics=MetricsWriter(clickhouse, database),
                             progress=lines.append)

    first = [transition(f"a{i}", model, advantage=1.0 if i % 2 else -1.0) for i in range(4)]
    stale = [transition(f"s{i}", model, version=0) for i in range(3)]
    second = [transition(f"b{i}", model, version=1) for i in range(4)]
    third = [transition(f"c{i}", model, version=2) for i in range(4)]

    async def first_run() -> TrainerWorker:
        running = worker()
        task = asyncio.create_task(running.run(max_steps=2))
        others = [transition("x0", "another-model"), transition("x1", "another-model")]
        await produce(kafka_options, topic, first + others)
        await until(lambda: running.version == 1)
        await produce(kafka_options, topic, stale + first[:2])  # stale at v1 (lag 1 > 0), and replays
        await produce(kafka_options, topic, second, as_batch=True)
        await asyncio.wait_for(task, 60)
        return running

    done = asyncio.run(first_run())
    assert (done.version, done.step) == (2, 2)

    async def second_run() -> TrainerWorker:  # a restart: resumes at v2 and knows what v1 and v2 learnt from
        running = worker()
        task = asyncio.create_task(running.run(max_steps=1))
        await produce(kafka_options, topic, first + second + stale + third)
        await asyncio.wait_for(task, 60)
        return running

    resumed = asyncio.run(second_run())
    assert (resumed.version, resumed.step) == (3, 3)
    assert any("resumed from version 2 (step 2)" in line for line in lines)

    store = open_store(config.trainer.checkpoint_dir)
    lineage = manifests(store, model)
    assert [(m.version, m.step, sorted(m.trained_ids)) for m in lineage] == [
        (1, 1, ["a0", "a1", "a2", "a3"]), (2, 2, ["b0", "b1", "b2", "b3"]), (3, 3, ["c0", "c1", "c2", "c3"])]
    assert all(m.sha256 and m.uri.startswith("file://") for m in lineage)
    # the optimizer state goes with every second version; v2, which the restart resumed from, had it
    assert [(store.get(m.uri) / "optimizer.pt").is_file() for m in lineage] == [False, True, False]
    assert not any("moments start afresh" in line for line in lines)

    rows = clickhouse.query(
        f"SELECT step, policy_version, transitions, tokens, dropped_stale, staleness_max, reward_mean, "
        f"importance_weight_mean FROM {database}.train_steps FINAL WHERE model = {{m:String}} ORDER BY step",
        parameters={"m": model}).result_rows
    assert [row[:6] for row in rows] == [(1, 0, 4, 24, 0, 0), (2, 1, 4, 24, 3, 0), (3, 2, 4, 24, 3, 0)]
    assert all(row[6] == 1.0 and row[7] > 0 for row in rows)
    checkpoints = clickhouse.query(f"SELECT version, step FROM {database}.checkpoints FINAL WHERE model = {{m:String}} "
                                   "ORDER BY version", parameters={"m": model}).result_rows
    assert checkpoints == [(1, 1), (2, 2), (3, 3)]

    events = [event for key, event in asyncio.run(checkpoint_events(kafka_options, config)) if key == model]
    assert sorted({e["version"] for e in events}) == [1, 2, 3]  # v2 announced again on resume: harmless
    assert all(e["format"] == "full" and e["uri"].startswith("file://") for e in events)

    async def committed() -> int:
        consumer = AIOKafkaConsumer(**kafka_options, group_id=f"agentstream-trainer-{model}", enable_auto_commit=False)
        await consumer.start()
        try:
            tps = [TopicPartition(topic, p) for p in range(config.topics.partitions)]
            consumer.assign(tps)
            return sum([await consumer.committed(tp) or 0 for tp in tps])
        finally:
            await consumer.stop()

    # 4 + 6 + 15 records of this model landed; every one is trained, dropped or skipped, so all are committed
    assert asyncio.run(committed()) >= 4 + 6 + 15



def test_a_killed_trainer_resumes_from_its_checkpoint_and_trains_no_transition_twice(
        topics_config, stack, kafka_options, tmp_path, clickhouse, stack_config):
    model = f"tiny-crash-{uuid.uuid4().hex[:6]}"
    database = f"trainer_{uuid.uuid4().hex[:8]}"
    checkpoints = tmp_path / "checkpoints"
    env = worker_env(tmp_path, stack, topics_config.topics.prefix, database,
                  tiny_trainer_toml(model, checkpoints))
    asyncio.run(create_topics(topics_config, stack.bootstrap_servers))
    topic = topic_name(topics_config.topics, "transitions")
    records = [transition(f"t{i:02d}", model, advantage=(-1.0) ** i) for i in range(40)]

    trainer = CliProcess(["train-worker"], env, tmp_path / "trainer.log").start()
    try:
        asyncio.run(produce(kafka_options, topic, records[:20]))
        trainer.wait_for("step     5")  # steps 1-4 checkpointed (v1, v2); step 5 trained, not checkpointed
        trainer.wait_for("checkpoint v2")
        time.sleep(0.3)
        trainer.kill()
        assert "checkpoint v3" not in trainer.log()
        # after the crash: the rest, plus replays of transitions from checkpointed (t00..t03) and lost (t16) steps
        asyncio.run(produce(kafka_options, topic, [*records[20:], records[0], records[3], records[16]]))
        trainer = CliProcess(["train-worker"], env, tmp_path / "trainer.log").start()
        trainer.wait_for("resumed from version 2 (step 4)")
        trainer.wait_for("checkpoint v5 (step 10)")
    finally:
        trainer.stop()

    lineage = manifests(open_store(str(checkpoints)), model)
    assert [m.version for m in lineage] == [1, 2, 3, 4, 5]
    trained = [transition_id for m in lineage for transition_id in m.trained_ids]
    assert len(trained) == len(set(trained)) == 40  # every transition exactly once in the final model's lineage
    assert set(trained) == {r["transition_id"] for r in records}
    steps = clickhouse.query(f"SELECT step, transitions FROM {database}.train_steps FINAL WHERE model = {{m:String}} "
                             "ORDER BY step", parameters={"m": model}).result_rows
    assert steps == [(step, 4) for step in range(1, 11)]  # step 5 ran twice; its row was replaced
    log = trainer.log()
    print("\n".join(line for line in log.splitlines() if "resumed" in line or "checkpoint v" in line))
    clickhouse.command(f"DROP DATABASE IF EXISTS {database}")


def test_a_second_trainer_stands_by_and_takes_over_from_the_last_checkpoint_when_the_first_dies(
        topics_config, stack, kafka_options, tmp_path):
    model = f"tiny-standby-{uuid.uuid4().hex[:6]}"
    checkpoints = tmp_path / "checkpoints"
    env = worker_env(tmp_path, stack, topics_config.topics.prefix, f"trainer_{uuid.uuid4().hex[:8]}",
                     tiny_trainer_toml(model, checkpoints))
    asyncio.run(create_topics(topics_config, stack.bootstrap_servers))
    topic = topic_name(topics_config.topics, "transitions")
    records = [transition(f"t{i:02d}", model, advantage=(-1.0) ** i) for i in range(24)]

    active = CliProcess(["train-worker"], env, tmp_path / "active.log").start()
    standby = CliProcess(["train-worker"], env, tmp_path / "standby.log")
    try:
        active.wait_for("no checkpoint yet")  # it holds the lock: started together, either could have won it
        standby.start()
        standby.wait_for(f"another trainer of {model} is active here (pid {active.process.pid}")
        asyncio.run(produce(kafka_options, topic, records[:16]))
        active.wait_for("checkpoint v2 (step 4)")
        assert "step" not in standby.log()  # standing by reads nothing
        active.kill()
        standby.wait_for(f"taking over from pid {active.process.pid}")
        standby.wait_for("resumed from version")
        asyncio.run(produce(kafka_options, topic, records[16:]))
        standby.wait_for("checkpoint v3 (step 6)")
    finally:
        standby.stop()
        active.stop()

    lineage = manifests(open_store(str(checkpoints)), model)
    assert [m.version for m in lineage] == [1, 2, 3]
    trained = [transition_id for m in lineage for transition_id in m.trained_ids]
    assert len(trained) == len(set(trained)) == 24  # each transition once, across both processes
    assert f"{tmp_path / 'home' / 'trainers' / model}.lock" in standby.log()


def test_a_backlog_published_before_the_trainer_started_is_trained_without_waiting_out_the_batch_wait(
        trainer_setup, stack, kafka_options):
    config, model = trainer_setup  # batch_wait_s=60, batch_transitions=4
    topic = topic_name(config.topics, "transitions")
    published_at_ms = int((time.time() - 120) * 1000)  # published two minutes ago, as if while no trainer ran

    async def backlog() -> None:
        producer = AIOKafkaProducer(**kafka_options, acks="all")
        await producer.start()
        try:
            for number in range(2):
                await producer.send_and_wait(topic, key=model.encode(), timestamp_ms=published_at_ms,
                                             value=CODEC.encode(TRANSITION, transition(f"late{number}", model)))
        finally:
            await producer.stop()

    async def train() -> int:
        await backlog()
        worker = TrainerWorker(config, stack.bootstrap_servers, progress=lambda line: None)
        summary = await asyncio.wait_for(worker.run(max_steps=1), timeout=40)  # 60 s if read time counted
        return summary.transitions

    assert asyncio.run(train()) == 2


def test_a_rebase_setting_without_the_deployments_log_is_a_config_error():
    config = Config(trainer=TrainerConfig(model="tiny", rebase_after_rejections=2))
    with pytest.raises(TrainerConfigError, match="rebase_after_rejections"):
        TrainerWorker(config, "127.0.0.1:1")


def test_after_a_streak_of_refused_candidates_the_trainer_trains_on_from_the_serving_version(
        trainer_setup, stack, kafka_options):
    config, model = trainer_setup
    config = replace(config, trainer=replace(config.trainer, lora=True, lora_r=4, lora_alpha=16, lr=5e-2,
                                             max_policy_lag=1000, rebase_after_rejections=2))
    topic = topic_name(config.topics, "transitions")
    store = open_store(config.trainer.checkpoint_dir)
    lines: list[str] = []

    def adapter(policy) -> dict:
        from peft import get_peft_model_state_dict
        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(policy.model).items()}

    def saved(version: int) -> dict:
        from safetensors.torch import load_file
        uri = next(m.uri for m in manifests(store, model) if m.version == version)
        return load_file(store.get(uri) / ADAPTER_WEIGHTS_FILE)

    def same(left: dict, right: dict) -> bool:
        return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)

    async def scenario() -> TrainerWorker:
        running = TrainerWorker(config, stack.bootstrap_servers, progress=lines.append, rebase=RejectionStreak)
        log = DeploymentLog(config, stack.bootstrap_servers)
        await log.start()
        old = decide(Routing(model), 1, Action.REJECTED, "gate", "made before this trainer started")
        await log.record(old)
        await log.record(decide(old.routing, 2, Action.REJECTED, "gate", "made before this trainer started"))
        task = asyncio.create_task(running.run(max_steps=4))
        for version in (1, 2, 3):
            await produce(kafka_options, topic, [transition(f"v{version}-{i}", model, advantage=(-1.0) ** i)
                                                 for i in range(4)])
            await until(lambda v=version: running.version == v and running._writing is None)
        assert running.summary.rebases == 0  # the history's two rejections did not count
        promoted = decide(Routing(model), 1, Action.PROMOTED, "gate", "canary passed", stable_version=1,
                          stable_uri=next(m.uri for m in manifests(store, model) if m.version == 1))
        await log.record(promoted)
        await log.record(decide(promoted.routing, 2, Action.REJECTED, "gate", "worse"))
        assert not same(adapter(running.policy), saved(1))
        await log.record(decide(promoted.routing, 3, Action.ROLLED_BACK, "gate", "canary worse"))
        await until(lambda: running.summary.rebases == 1)
        assert same(adapter(running.policy), saved(1))  # v1's weights, not v3's
        await produce(kafka_options, topic, [transition(f"v4-{i}", model, advantage=(-1.0) ** i) for i in range(4)])
        await asyncio.wait_for(task, 60)
        await log.stop()
        return running

    done = asyncio.run(scenario())
    assert (done.version, done.summary.rebases) == (4, 1)
    assert any("back to v1, the version serving, after the gate refused 2 candidates in a row (v2, v3)" in line
               for line in lines)
    v4 = next(m for m in manifests(store, model) if m.version == 4)
    assert v4.metrics["rebased_on_version"] == 1.0
    assert "rebased_on_version" not in next(m for m in manifests(store, model) if m.version == 3).metrics


def test_trajectory_samples_and_demonstrations_train_and_their_merges_and_breaks_reach_train_steps(
        trainer_setup, stack, kafka_options, clickhouse, stack_config):
    config, model = trainer_setup
    database = stack_config.clickhouse.database
    topic = topic_name(config.topics, "transitions")
    lines: list[str] = []

    def merged(transition_id: str, calls: int, **fields) -> dict:
        """A sample of ``calls`` calls of 2 generated tokens with 3 masked tool-result tokens between them."""
        response = [t for call in range(calls) for t in ([80 + call, 81] + ([90, 91, 92] if call < calls - 1 else []))]
        mask = [t < 90 for t in response]
        return {**transition(transition_id, model), "response_token_ids": response, "loss_mask": mask,
                "behaviour_logprobs": [-5.0 if kept else 0.0 for kept in mask], "merged_calls": calls, **fields}

    records = [merged("m0", 3), merged("m1", 2, split_at_break=True),
               merged("demo", 2, behaviour_logprobs=[]),  # a scripted trajectory: trained by likelihood
               transition("plain", model),
               merged("bad-demo", 2, behaviour_logprobs=[], advantage=-1.0),  # unlikelihood: refused, counted
               merged("bad-mask", 2, loss_mask=[True, False])]

    async def scenario() -> TrainerWorker:
        running = TrainerWorker(config, stack.bootstrap_servers, metrics=MetricsWriter(clickhouse, database),
                                progress=lines.append)
        task = asyncio.create_task(running.run(max_steps=1))
        await produce(kafka_options, topic, records, as_batch=True)
        await asyncio.wait_for(task, 60)
        return running

    done = asyncio.run(scenario())
    assert (done.step, done.summary.transitions) == (1, 4)
    row = clickhouse.query(f"SELECT transitions, calls_per_sample, prefix_breaks FROM {database}.train_steps FINAL "
                           "WHERE model = {m:String}", parameters={"m": model}).result_rows
    assert row == [(4, (3 + 2 + 2 + 1) / 4, 1)]
    step_line = next(line for line in lines if line.startswith("step "))
    assert "bad 2" in step_line and "calls/sample 2.00 breaks 1" in step_line

"""A non-finite reward written straight onto the topics never reaches a transition, the weights or a checkpoint.

A client that skips every check (the SDK, proxy and collector refuse such rewards) produces span
records with a NaN or infinite reward onto the spans topic, and transitions with a NaN advantage
or logprob onto the transitions topic, beside ordinary rollouts. A real `agentstream streams`
worker and `agentstream train-worker` process them on the real broker and ClickHouse: the span
records land in the dlq with their reason, every transition published and stored is finite, the
trainer drops the bad transitions it was sent, and every checkpoint it writes holds only finite
weights. A second test drives the trainer itself into non-finite weights (a learning rate of
1e39) and shows that such a checkpoint is never written.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from aiokafka import AIOKafkaConsumer, TopicPartition
from safetensors.torch import load_file

from agentstream.infra.kafka import create_topics as create_kafka_topics
from agentstream.infra.kafka import topic_name
from agentstream.models import NonFiniteWeights
from agentstream.schemas import AvroCodec
from agentstream.trainer.checkpoint_writer import manifests, open_store
from agentstream.trainer.metrics import MetricsWriter
from agentstream.trainer.worker import TrainerWorker
from tests.integration.test_trainer_worker import produce as produce_transitions
from tests.integration.test_trainer_worker import transition
from tests.support.streams_harness import (
    CliProcess,
    Worker,
    create_topics,
    produce,
    rollout_records,
    wait_for,
    worker_env,
)

CODEC = AvroCodec()
CONFIG = """
[topics]
partitions = 1

[streams]
app_id = "nan-{tag}"
grace_s = 0.2
session_timeout_s = 3

[[credit]]
agent = "grpo-*"
strategy = "grpo"
group_size = 4
group_timeout_s = 3

[[credit]]
agent = "*"
strategy = "baseline"  # a NaN let into its running mean would make every later advantage NaN

[trainer]
model = "tiny"
model_name = "{model}"
device = "cpu"
threads = 1
lr = 0.003
batch_transitions = 4
batch_tokens = 0
batch_wait_s = 3
max_policy_lag = 100
checkpoint_every_steps = 1
checkpoint_dir = "{checkpoints}"
session_timeout_s = 3
"""


def read_topic_values(bootstrap: str, topic: str) -> list[tuple[bytes | None, dict]]:
    """Every record of a one-partition topic, decoded, from the beginning to where it stops growing."""
    async def go() -> list[tuple[bytes | None, dict]]:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            partition = TopicPartition(topic, 0)
            consumer.assign([partition])
            await consumer.seek_to_beginning(partition)
            found = []
            while batch := await consumer.getmany(timeout_ms=1500):
                for records in batch.values():
                    found.extend((record.key, CODEC.decode(record.value)[1]) for record in records)
            return found
        finally:
            await consumer.stop()

    return asyncio.run(go())


def transitions_of(values: list[tuple[bytes | None, dict]]) -> list[dict]:
    return [item for _, value in values for item in value.get("transitions", [value])]


def finite_weights(folder: Path) -> bool:
    """Read independently of the code under test: every floating tensor of every safetensors file is finite."""
    tensors = {name: tensor for file in folder.glob("*.safetensors") for name, tensor in load_file(file).items()}
    assert tensors, f"no weights in {folder}"
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def test_non_finite_rewards_on_the_topic_reach_no_transition_and_no_checkpoint(tmp_path, stack, clickhouse):
    tag = uuid.uuid4().hex[:8]
    database, model, prefix = f"nan_{tag}", f"nan-{tag}", f"nan{tag}."
    env = worker_env(tmp_path, stack, prefix, database,
                     CONFIG.format(tag=tag, model=model, checkpoints=tmp_path / "checkpoints"))
    create_topics(env)
    streams = Worker(env, tmp_path / "streams.log")
    trainer = CliProcess(["train-worker"], env, tmp_path / "trainer.log")
    items: list[tuple[bytes, bytes]] = []

    def add(rollout_id: str, reward: float, **kwargs) -> None:
        records = rollout_records(rollout_id, rewards=[(20, reward)], model=model, **kwargs)
        items.extend((rollout_id.encode(), value) for value in records)

    for index in range(8):
        add(f"b{index}", float(index % 2))
        if index == 1:
            add("poison-nan", math.nan)
        if index == 3:
            add("poison-dimension", 1.0, dimensions={"accuracy": 1.0, "speed": math.inf})
    for index, reward in enumerate([1.0, 0.0, 0.0, -math.inf]):
        add(f"grpo-{index}", reward, agent="grpo-a", group="g1")
    poisoned = [transition("injected-advantage", model, advantage=math.nan),
                {**transition("injected-logprob", model), "behaviour_logprobs": [-math.inf, -0.5]}]
    try:
        streams.start()
        trainer.start()
        asyncio.run(produce(stack.bootstrap_servers, f"{prefix}spans", items))
        options = {"bootstrap_servers": stack.bootstrap_servers}
        asyncio.run(produce_transitions(options, f"{prefix}transitions", poisoned))

        def stored() -> int:
            return clickhouse.query(f"SELECT count() FROM {database}.transitions FINAL").result_rows[0][0]

        wait_for(stored, timeout_s=60, what="8 baseline and 3 grpo transitions stored", equals=11)
        store_folder = tmp_path / "checkpoints"
        wait_for(lambda: len(manifests(open_store(str(store_folder)), model)) >= 2, timeout_s=90,
                 what="two checkpoints")
        letters = [value for _, value in read_topic_values(stack.bootstrap_servers, f"{prefix}dlq")]
    finally:
        trainer.stop()
        streams.stop()

    assert sorted((letter["key"], letter["error_type"]) for letter in letters) == [
        (b"grpo-3", "NonFiniteReward"), (b"poison-dimension", "NonFiniteReward"), (b"poison-nan", "NonFiniteReward")]
    assert all("a reward must be a finite number" in letter["error"] and letter["value"] for letter in letters)
    assert any("reward dimension 'speed' = inf" in letter["error"] for letter in letters)

    rows = clickhouse.query(f"SELECT rollout_id, reward, return_value, advantage, arrayAll(x -> isFinite(x), "
                            f"behaviour_logprobs) FROM {database}.transitions FINAL").result_rows
    assert sorted(row[0] for row in rows) == sorted([f"b{i}" for i in range(8)] + ["grpo-0", "grpo-1", "grpo-2"])
    assert all(math.isfinite(value) for row in rows for value in row[1:4]) and all(row[4] for row in rows)
    baseline = [row[3] for row in rows if row[0].startswith("b")]
    assert baseline.count(0.0) == 1  # only the first rollout has no mean to compare with: the mean outlived the NaN

    published = [t for t in transitions_of(read_topic_values(stack.bootstrap_servers, f"{prefix}transitions"))
                 if not t["transition_id"].startswith("injected")]
    assert len(published) == 11
    assert all(math.isfinite(t[key]) for t in published for key in ("reward", "return_value", "advantage"))

    log = trainer.log()
    assert log.count("skipped a transition") == 2 and "advantage nan" in log and "(-inf)" in log
    lineage = manifests(open_store(str(tmp_path / "checkpoints")), model)
    assert len(lineage) >= 2
    for manifest in lineage:
        assert finite_weights(Path(manifest.uri.removeprefix("file://"))), manifest.version
    steps = clickhouse.query(f"SELECT count(), sum(skipped_nonfinite), countIf(NOT isFinite(loss)) "
                             f"FROM {database}.train_steps FINAL WHERE model = {{m:String}}",
                             parameters={"m": model}).result_rows[0]
    assert steps[0] >= 2 and steps[1:] == (0, 0)  # no step ever saw a NaN
    clickhouse.command(f"DROP DATABASE IF EXISTS {database}")


@pytest.fixture
def trainer_config(topics_config, tmp_path, stack):
    from agentstream.infra.config import TrainerConfig

    name = f"tiny-{uuid.uuid4().hex[:8]}"
    trainer = TrainerConfig(model="tiny", model_name=name, device="cpu", threads=1, lr=1e-3, batch_transitions=4,
                            batch_tokens=0, batch_wait_s=60, max_policy_lag=100,
                            checkpoint_dir=str(tmp_path / "ckpt"), session_timeout_s=3,
                            optimizer_state_every=0)  # AdamW's saved state would bring its own learning rate back
    config = replace(topics_config, trainer=trainer, stack=replace(topics_config.stack, home=tmp_path))
    asyncio.run(create_kafka_topics(config, stack.bootstrap_servers))
    return config, name


def test_a_checkpoint_with_non_finite_weights_is_never_written(trainer_config, stack, kafka_options, clickhouse,
                                                               stack_config):
    """A learning rate of 1e39 turns the weights infinite in one step: the checkpoint is refused every time."""
    config, name = trainer_config
    topic = topic_name(config.topics, "transitions")
    lines: list[str] = []
    store = open_store(config.trainer.checkpoint_dir)

    def worker(**changes) -> TrainerWorker:
        return TrainerWorker(replace(config, trainer=replace(config.trainer, **changes)), stack.bootstrap_servers,
                             metrics=MetricsWriter(clickhouse, stack_config.clickhouse.database),
                             progress=lines.append)

    def batch(prefix: str) -> list[dict]:
        return [transition(f"{prefix}{i}", name, advantage=1.0 if i % 2 else -1.0) for i in range(4)]

    async def run(records: list[dict], changes: dict, **kwargs) -> TrainerWorker:
        running = worker(**changes)  # made on the loop that runs it (its producer belongs to that loop)
        task = asyncio.create_task(running.run(**kwargs))
        await produce_transitions(kafka_options, topic, records)
        await asyncio.wait_for(task, 60)
        return running

    # no checkpoint yet: nothing good to go back to, so the worker stops with the error, having written nothing
    with pytest.raises(NonFiniteWeights, match="no checkpoint to go back to"):
        asyncio.run(run(batch("a"), {"lr": 1e39}, max_steps=1))
    assert manifests(store, name) == []

    good = asyncio.run(run([], {}, max_steps=1))  # the same transitions, read again, at a sane rate
    assert good.summary.checkpoints == 1 and [m.version for m in manifests(store, name)] == [1]

    async def explode() -> TrainerWorker:
        stop = asyncio.Event()
        running = worker(lr=1e39, checkpoint_every_steps=2)
        task = asyncio.create_task(running.run(stop))
        await produce_transitions(kafka_options, topic, batch("b") + batch("c") + batch("d"))
        deadline = time.monotonic() + 60
        while running.summary.skipped_nonfinite < 2:  # one step makes the weights infinite; the next losses are NaN
            assert time.monotonic() < deadline and not task.done(), lines[-5:]
            await asyncio.sleep(0.1)
        stop.set()  # on the way out the checkpoint of that step is refused and v1's weights come back
        await asyncio.wait_for(task, 60)
        return running

    exploded = asyncio.run(explode())
    summary = exploded.summary
    assert (summary.steps, summary.skipped_nonfinite, summary.refused_checkpoints) == (1, 2, 1)
    assert [m.version for m in manifests(store, name)] == [1]  # nothing was written after v1
    assert any("step skipped: loss nan" in line for line in lines)
    assert any(f"trainer {name}: v2 refused (a weight is not finite); training on from v1's weights" in line
               for line in lines)
    assert all(bool(torch.isfinite(p).all()) for p in exploded.policy.model.parameters())  # back on v1's weights
    v1 = store.get(manifests(store, name)[0].uri)
    assert finite_weights(v1)
    assert all(torch.equal(load_file(v1 / "model.safetensors")[key], tensor)
               for key, tensor in exploded.policy.model.state_dict().items()
               if key in load_file(v1 / "model.safetensors"))

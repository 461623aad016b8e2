"""The whole loop on a three-broker Apache Kafka cluster (RF 3, min.insync.replicas 2, acks=all) that loses brokers.

A ledgered SpanPublisher (tests/support/span_ledger.py: a span id is in the ledger only once ``flush()`` said the
cluster acknowledged it or the journal holds it) publishes rollouts at a steady pace; a real `agentstream streams`
worker writes spans, rollouts and transitions to ClickHouse (the session's, a database of its own) and publishes
transitions; a real tiny `train-worker` trains on them. Then:

- the broker that leads most spans partitions is SIGKILLed mid-load: no acknowledged span is missing from
  ClickHouse, no span is stored twice (a span id in two records of the spans topic, or in two rows of the spans
  table read without FINAL), every transition the worker stored was trained exactly once (the checkpoints'
  ``trained_ids``); the killed node, restarted on its data, is back in every partition's ISR;
- two of the three are stopped: publish() stays quick while the journal holds the spans the cluster refuses, and
  once both are back every acknowledged span reaches ClickHouse, once per span id after FINAL (a batch given up
  on at the request timeout may have been appended anyway, and its replay writes it twice: that count is printed).

The seconds until spans flow again, and the counts, are printed as JSON lines. One cluster serves the module.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import Config, load_config
from agentstream.infra.kafka import TopicSpec, client_options, ensure_topics, topic_name, topic_partitions
from agentstream.schemas.transition_writer import transition_id
from agentstream.trainer.checkpoint_writer import manifests, open_store
from tests.support.cluster_load import Load, beyond_first, busiest_leader, first_ack_after, ids_on_topic
from tests.support.kafka_cluster import KafkaCluster
from tests.support.span_ledger import LEDGER_ENV, LedgeredPublisher, LedgerReader, LedgerState
from tests.support.streams_harness import CliProcess, Worker, create_topics, wait_for, worker_env
from tests.support.trainer_configs import tiny_trainer_toml

pytestmark = pytest.mark.own_broker  # its own three nodes: the second pass (the session broker on Kafka) adds nothing

CONFIG = """
[topics]
partitions = 6
replication_factor = 3

[streams]
app_id = "cluster-{tag}"
grace_s = 0.2
idle_timeout_s = 1.5

[[credit]]
agent = "*"
strategy = "final"

"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[KafkaCluster]:
    running = KafkaCluster(tmp_path_factory.mktemp("kafka-cluster"))
    try:
        yield running.start()
    finally:
        running.stop_all()


@dataclass
class Pipeline:
    """The loop's processes on the cluster for one test: topics, a streams worker, optionally a trainer, and the
    ledgered publisher with its load."""

    config: Config
    database: str
    model: str
    ledger: Path
    checkpoints: Path
    worker: Worker
    trainer: CliProcess | None
    publisher: LedgeredPublisher
    load: Load

    @classmethod
    def start(cls, tmp_path: Path, cluster: KafkaCluster, stack, monkeypatch, *, trainer: bool,
              request_timeout_ms: int = 30_000) -> Pipeline:
        tag = uuid.uuid4().hex[:8]
        model, checkpoints, database = f"tiny-{tag}", tmp_path / "checkpoints", f"cluster_{tag}"
        toml = CONFIG.format(tag=tag) + tiny_trainer_toml(model, checkpoints, checkpoint_every_steps=1,
                                                          batch_transitions=32, batch_wait_s=2)
        on_cluster = SimpleNamespace(bootstrap_servers=cluster.bootstrap_servers, clickhouse_url=stack.clickhouse_url)
        env = worker_env(tmp_path, on_cluster, f"c{tag}.", database, toml)
        create_topics(env)
        config = load_config(environ=env)
        worker = Worker(env, tmp_path / "worker.log").start(timeout_s=90)
        trainer_process = None
        if trainer:
            trainer_process = CliProcess(["train-worker"], env, tmp_path / "trainer.log").start()
            trainer_process.wait_for("no checkpoint yet", 90)
        ledger = tmp_path / "ledger" / "publisher.ledger"
        ledger.parent.mkdir()
        monkeypatch.setenv(LEDGER_ENV, str(ledger))
        publisher = LedgeredPublisher(config, cluster.bootstrap_servers, journal_dir=tmp_path / "journal",
                                      request_timeout_ms=request_timeout_ms).start()
        load = Load(publisher, model, f"r{tag}")
        load.start()
        return cls(config, database, model, ledger, checkpoints, worker, trainer_process, publisher, load)

    @property
    def options(self) -> dict:
        return client_options(self.config.kafka, self.config.kafka.bootstrap_servers)

    def query(self, sql: str) -> list:
        client = connect(self.config.clickhouse, self.config.clickhouse.url, database=self.database)
        try:
            return list(client.query(sql).result_rows)
        finally:
            client.close()

    def stored_spans(self) -> set[str]:
        return {row[0] for row in self.query("SELECT span_id FROM spans FINAL")}

    def acknowledged(self) -> LedgerState:
        return LedgerReader(self.ledger.parent).poll()

    def drain_spans(self, timeout_s: float = 120.0) -> tuple[LedgerState, set[str]]:
        """Stop the load, close the publisher (everything acknowledged or journaled), wait for ClickHouse to have
        every acknowledged span; returns the ledger and the stored span ids."""
        self.load.finish()
        self.publisher.close(60)
        state = self.acknowledged()
        wait_for(lambda: not set(state.spans) - self.stored_spans(), timeout_s, interval_s=1,
                 what="every acknowledged span in ClickHouse")
        return state, self.stored_spans()

    def stop(self) -> None:
        self.load.finish()
        self.publisher.close(5)
        for process in (self.trainer, self.worker):
            if process is not None and process.running:
                process.stop(30)
        client = connect(self.config.clickhouse, self.config.clickhouse.url)
        client.command(f"DROP DATABASE IF EXISTS {self.database}")
        client.close()


@pytest.fixture
def pipelines() -> Iterator[list[Pipeline]]:
    started: list[Pipeline] = []
    yield started
    for pipeline in started:
        pipeline.stop()


def emit(metric: str, **fields: object) -> None:
    print(json.dumps({"metric": metric, **fields}), flush=True)


def wait_in_sync(cluster: KafkaCluster, topics: list[str], node_id: int, timeout_s: float = 120.0) -> float:
    """Seconds until ``node_id`` is in the ISR of every partition of ``topics`` again."""
    began = time.monotonic()
    wait_for(lambda: all(node_id in isr for topic in topics for _leader, isr in cluster.partitions(topic).values()),
             timeout_s, interval_s=0.5, what=f"node {node_id} back in every ISR")
    return time.monotonic() - began


def test_leader_kill_under_load_loses_nothing_and_stores_nothing_twice(cluster, tmp_path, stack, monkeypatch,
                                                                       pipelines):
    pipeline = Pipeline.start(tmp_path, cluster, stack, monkeypatch, trainer=True)
    pipelines.append(pipeline)
    spans_topic = topic_name(pipeline.config.topics, "spans")
    transitions_topic = topic_name(pipeline.config.topics, "transitions")
    wait_for(lambda: pipeline.stored_spans(), 60, what="spans flowing into ClickHouse")
    time.sleep(3)
    victim = busiest_leader(cluster, spans_topic)
    led = sum(leader == victim for leader, _isr in cluster.partitions(spans_topic).values())
    killed_at = time.time()
    cluster.kill(victim)
    time.sleep(15)  # the controller fences the dead broker after its session (9 s by default) and moves leaders
    restarted = time.monotonic()
    cluster.restart(victim)
    registered_s = time.monotonic() - restarted
    catch_up_s = registered_s + wait_in_sync(cluster, [spans_topic, transitions_topic], victim)
    after_kill = pipeline.load.first_after(killed_at)
    state, stored = pipeline.drain_spans()

    acked_again_s = first_ack_after(state.spans, after_kill) - killed_at
    stored_again_s = pipeline.query("SELECT toUnixTimestamp64Milli(min(ingested_at)) FROM spans "
                                    f"WHERE rollout_id >= '{after_kill}'")[0][0] / 1000 - killed_at
    lost = set(state.spans) - stored
    on_topic = ids_on_topic(pipeline.options, cluster, spans_topic)
    twice_on_topic = beyond_first(on_topic)
    rows, distinct = pipeline.query("SELECT count(), uniqExact(span_id) FROM spans")[0]  # no FINAL: every insert

    expected = {transition_id(rollout, attempt, span_id) for span_id, (_p, rollout, attempt, kind, *_r)
                in state.spans.items() if kind == "LLM"}
    wait_for(lambda: not expected - {row[0] for row in pipeline.query("SELECT transition_id FROM transitions FINAL")},
             90, interval_s=1, what="every expected transition in ClickHouse")
    store = open_store(str(pipeline.checkpoints))

    def trained() -> Counter[str]:
        return Counter(tid for manifest in manifests(store, pipeline.model) for tid in manifest.trained_ids)

    wait_for(lambda: not expected - set(trained()), 120, interval_s=1, what="every transition trained")
    assert pipeline.trainer is not None
    pipeline.trainer.stop(30)  # its last checkpoint names whatever it trained since the previous one
    trained_ids = trained()
    transitions_twice_on_topic = beyond_first(ids_on_topic(pipeline.options, cluster, transitions_topic))
    emit("cluster_leader_kill", victim=victim, spans_partitions_led=led, spans_acked=len(state.spans),
         spans_lost=len(lost), spans_twice_on_topic=twice_on_topic, span_rows_beyond_one=rows - distinct,
         acked_again_s=round(acked_again_s, 2), stored_again_s=round(stored_again_s, 2),
         restart_registered_s=round(registered_s, 2), restart_in_sync_s=round(catch_up_s, 2),
         transitions_expected=len(expected),
         transitions_untrained=len(expected - set(trained_ids)), transitions_trained_twice=beyond_first(trained_ids),
         transitions_twice_on_topic=transitions_twice_on_topic, publisher=vars(pipeline.publisher.stats()))
    assert state.spans and not lost, f"{len(lost)} acknowledged spans missing from ClickHouse"
    assert not set(state.spans) - set(on_topic), "an acknowledged span is not on the spans topic"
    assert twice_on_topic == 0, f"{twice_on_topic} span records written twice to the spans topic"
    assert rows == distinct, f"{rows - distinct} span rows stored twice (spans without FINAL)"
    assert not expected - set(trained_ids) and beyond_first(trained_ids) == 0
    assert set(trained_ids) <= expected, "trained a transition no acknowledged span made"


def test_two_of_three_down_holds_spans_in_the_journal_and_loses_none(cluster, tmp_path, stack, monkeypatch,
                                                                   pipelines):
    pipeline = Pipeline.start(tmp_path, cluster, stack, monkeypatch, trainer=False, request_timeout_ms=5000)
    pipelines.append(pipeline)
    spans_topic = topic_name(pipeline.config.topics, "spans")
    wait_for(lambda: pipeline.stored_spans(), 60, what="spans flowing into ClickHouse")
    down = [2, 3]
    for node_id in down:
        cluster.stop(node_id)
    stopped_at = time.time()
    wait_for(lambda: pipeline.publisher.stats().spans_journaled > 0, 60, interval_s=0.5,
             what="the publisher journaling while two brokers are down")
    journaled = pipeline.publisher.stats().spans_journaled
    slowest_during_outage = pipeline.load.slowest_call_s
    for node_id in down:
        cluster.restart(node_id)
    back_at = time.time()
    time.sleep(3)
    after_return = pipeline.load.first_after(back_at)
    state, stored = pipeline.drain_spans()
    lost = set(state.spans) - stored
    on_topic = ids_on_topic(pipeline.options, cluster, spans_topic)
    twice_on_topic = beyond_first(on_topic)
    final_rows = pipeline.query("SELECT count() FROM spans FINAL")[0][0]
    emit("cluster_two_down", outage_s=round(back_at - stopped_at, 1), spans_acked=len(state.spans),
         spans_journaled_in_outage=journaled, spans_lost=len(lost), spans_twice_on_topic=twice_on_topic,
         slowest_publish_call_s=round(slowest_during_outage, 3),
         acked_again_s=round(first_ack_after(state.spans, after_return) - back_at, 2),
         publisher=vars(pipeline.publisher.stats()))
    assert journaled > 0
    assert slowest_during_outage < 1.0, "publish() blocked its caller while the cluster refused writes"
    assert state.spans and not lost, f"{len(lost)} acknowledged spans missing from ClickHouse"
    assert not set(state.spans) - set(on_topic), "an acknowledged span is not on the spans topic"
    # a batch the publisher gave up on after its request timeout may have been appended all the same; its journal
    # replay (a new producer, so idempotence cannot tell) then writes it twice: ids make ClickHouse keep one row
    assert final_rows == len(on_topic), f"{final_rows} span rows (FINAL) for {len(on_topic)} span ids"


def test_topics_created_on_the_cluster_are_ready_when_creation_returns(cluster):
    """A topic the controller just created reaches the other brokers a moment later: creation waits for it (the
    streams worker once stopped at start with "topic ... exists but reports no partitions")."""
    tag = uuid.uuid4().hex[:8]
    specs = [TopicSpec(f"ready{tag}.{i}", f"ready{tag}.{i}", 6) for i in range(8)]

    async def create_then_describe() -> dict[str, int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap_servers)
        await admin.start()
        try:
            for spec in specs:  # one at a time: each creation is followed at once by a describe
                await ensure_topics(admin, [spec], replication_factor=3)
            return await topic_partitions(admin, [spec.name for spec in specs])
        finally:
            await admin.close()

    assert asyncio.run(create_then_describe()) == {spec.name: 6 for spec in specs}

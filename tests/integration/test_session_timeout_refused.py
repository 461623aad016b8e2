"""A stock Apache Kafka minimum session (``group.min.session.timeout.ms`` 6 s): each group consumer names the setting.

The embedded node and the test harnesses lower the broker's minimum to 1 s, so the 3 to 4 s sessions of the stream
workers, the trainer and the runners never met a stock broker's refusal (InvalidSessionTimeoutError, error 26, at the
group's first join). Here one node keeps the stock minimum: the streams worker process, the trainer and a runner
each stop with :class:`SessionTimeoutRefused` that says which setting to raise, within a bound.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from agentstream.infra.config import Config, TrainerConfig, load_config
from agentstream.infra.kafka import SessionTimeoutRefused, create_topics
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.runner.pool import Runner, RunnerOptions
from agentstream.stack.control import Endpoints
from agentstream.trainer.worker import TrainerWorker
from tests.support.kafka_cluster import KafkaCluster
from tests.support.streams_harness import CliProcess, worker_env

pytestmark = pytest.mark.own_broker  # its own node: the second pass (the session broker on Kafka) adds nothing

STOCK_MINIMUM = {"group.min.session.timeout.ms": "6000"}
"""Apache Kafka's default; the embedded node's properties lower it to 1000."""
BOUND_S = 60.0
"""The longest a refused consumer may take to stop (the worker process waits for ClickHouse and faust first)."""


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One plain Apache Kafka node with the stock minimum session; its bootstrap address."""
    node = KafkaCluster(tmp_path_factory.mktemp("stock-kafka"), size=1, settings=STOCK_MINIMUM).start()
    try:
        yield node.bootstrap_servers
    finally:
        node.stop_all()


@pytest.fixture
def config(kafka: str, tmp_path: Path) -> Config:
    """Own topics (created) and home on the stock node; sessions as the product's defaults set them."""
    loaded = load_config(environ={"AGENTSTREAM_HOME": str(tmp_path / "home"), "KAFKA_BOOTSTRAP_SERVERS": kafka,
                                  "AGENTSTREAM_TOPIC_PREFIX": f"st{uuid.uuid4().hex[:8]}."})
    asyncio.run(create_topics(loaded, kafka))
    return loaded


def test_streams_worker_exits_naming_its_session_setting(kafka: str, config: Config, stack: Endpoints,
                                                         tmp_path: Path) -> None:
    env = worker_env(tmp_path, stack, config.topics.prefix, f"stock_{uuid.uuid4().hex[:8]}")
    env["KAFKA_BOOTSTRAP_SERVERS"] = kafka
    worker = CliProcess(["streams"], env, tmp_path / "worker.log")
    worker.start()
    code = worker.exit_code(BOUND_S)
    lines = [line for line in worker.log().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 1 and errors == lines[-1:], "\n".join(lines[-40:])  # faust logs its crash, the last line says why
    assert errors[0].startswith("error: SessionTimeoutRefused: ") and "[streams] session_timeout_s" in errors[0]
    assert "group.min.session.timeout.ms" in errors[0]


def test_trainer_names_its_session_setting(config: Config, tmp_path: Path) -> None:
    trainer = TrainerConfig(model="tiny", model_name="stock-tiny", device="cpu", threads=1,
                            checkpoint_dir=str(tmp_path / "ckpt"), session_timeout_s=3)
    worker = TrainerWorker(replace(config, trainer=trainer), str(config.kafka.bootstrap_servers))
    started = time.monotonic()
    with pytest.raises(SessionTimeoutRefused, match=r"\[trainer\] session_timeout_s") as refused:
        asyncio.run(asyncio.wait_for(worker.run(), BOUND_S))
    assert time.monotonic() - started < BOUND_S and refused.value.retriable is False


def test_runner_names_its_session_option(config: Config, tmp_path: Path) -> None:
    bootstrap = str(config.kafka.bootstrap_servers)
    with SpanPublisher(config, bootstrap, journal_dir=tmp_path / "journal") as publisher:
        runner = Runner(lambda task: 1.0, config, bootstrap, publisher, RunnerOptions(session_timeout_ms=4000))
        started = time.monotonic()
        with pytest.raises(SessionTimeoutRefused, match="--session-timeout-ms") as refused:
            asyncio.run(asyncio.wait_for(runner.run(), BOUND_S))
    assert time.monotonic() - started < BOUND_S and refused.value.retriable is False

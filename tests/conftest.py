"""Session fixtures: a real tansu broker and a real ClickHouse (chdb over HTTP) on free loopback ports."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import Config, load_config
from agentstream.infra.kafka import client_options, create_topics
from agentstream.infra.processes import free_port
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.sdk import set_sink
from agentstream.stack.control import Endpoints, Stack
from tests.support.broker import PrivateBroker
from tests.support.streams_harness import stop_worker_stacks

TEST_BROKER = os.environ.get("AGENTSTREAM_TEST_BROKER", "tansu")
"""The broker the session stack runs: tansu (the default) or kafka (Apache Kafka 4.x, one KRaft node)."""
if TEST_BROKER not in ("tansu", "kafka"):
    raise pytest.UsageError(f"AGENTSTREAM_TEST_BROKER must be tansu or kafka, got {TEST_BROKER!r}")

SIDE_MARKERS = {"agl": "AGENTSTREAM_TEST_AGL", "registries": "AGENTSTREAM_TEST_REGISTRIES",
                "scenario": "AGENTSTREAM_TEST_SCENARIOS"}
"""Markers of tests `make test` leaves out, and the variable that lets them run."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by its folder: tests/unit needs nothing running, tests/integration a stack or processes.

    Tests with a side marker need what `make test` does not install, and run only where their variable is 1:
    ``agl`` the side environment with the real Agent Lightning (`make test-agl`), ``registries`` an independent
    Schema Registry built from its source (`make test-registries`); ``scenario`` tests need nothing more but take
    minutes each (`make test-scenarios`, which CI runs after `make test` where it fits).
    """
    tests = Path(__file__).parent
    for item in items:
        kind = item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else ""
        if kind in ("unit", "integration"):
            item.add_marker(kind)
    if TEST_BROKER == "kafka":
        # the second pass: only what talks to the session's broker; the rest already ran on tansu
        other = [item for item in items if "stack" not in getattr(item, "fixturenames", ())
                 or item.get_closest_marker("own_broker") or item.get_closest_marker("clickhouse_only")]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [item for item in items if item not in set(other)]
    for marker, variable in SIDE_MARKERS.items():
        if os.environ.get(variable) != "1":
            side = [item for item in items if item.get_closest_marker(marker)]
            if side:
                config.hook.pytest_deselected(items=side)
                items[:] = [item for item in items if not item.get_closest_marker(marker)]


def pytest_report_header(config: pytest.Config) -> str:
    return f"agentstream: session broker {TEST_BROKER} (AGENTSTREAM_TEST_BROKER)"


def stack_environment(home: Path) -> dict[str, str]:
    """Environment for an isolated stack: its own state folder and free ports, no external services, and the
    session's broker (``AGENTSTREAM_TEST_BROKER``)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_", "SCHEMA_REGISTRY_"))}
    env.update({
        "AGENTSTREAM_HOME": str(home),
        "AGENTSTREAM_BROKER": TEST_BROKER,
        "AGENTSTREAM_BROKER_PORT": str(free_port()),
        "AGENTSTREAM_CLICKHOUSE_PORT": str(free_port()),
        "AGENTSTREAM_SCHEMA_REGISTRY_PORT": str(free_port()),
    })
    return env


@pytest.fixture(scope="session")
def stack_config(tmp_path_factory) -> Config:
    return load_config(environ=stack_environment(tmp_path_factory.mktemp("stack")))


@pytest.fixture(scope="session")
def stack(stack_config: Config) -> Endpoints:
    """The running local stack, started once for the whole test session and stopped at its end."""
    running = Stack(stack_config)
    endpoints = running.up(timeout_s=60, progress=lambda line: None)
    yield endpoints
    try:
        stop_worker_stacks()
    finally:  # the session's broker and ClickHouse stop even where a test's home went first
        running.down(progress=lambda line: None)


@pytest.fixture(scope="session")
def kafka_options(stack_config: Config, stack: Endpoints) -> dict:
    return client_options(stack_config.kafka, stack.bootstrap_servers)


@pytest.fixture(scope="session")
def schema_registry(stack: Endpoints, tmp_path_factory):
    """A Schema Registry server process (the stack's kind: fingerprint ids, seeded) on its own topic and port."""
    from tests.support.schema_registry import RegistryProcess

    log_path = tmp_path_factory.mktemp("schema-registry") / "registry.log"
    registry = RegistryProcess(stack.bootstrap_servers, f"_schemas.{free_port()}", log_path).start()
    yield registry
    registry.stop()


@pytest.fixture
def clickhouse(stack_config: Config, stack: Endpoints):
    client = connect(stack_config.clickhouse, stack.clickhouse_url, database=stack_config.clickhouse.database)
    yield client
    client.close()


@pytest.fixture
def unique_prefix(request) -> str:
    """A topic prefix no other test uses, so tests never see each other's messages."""
    return f"t{abs(hash(request.node.nodeid)) % 10**8}."


@pytest.fixture
def topics_config(stack_config: Config, unique_prefix: str) -> Config:
    return replace(stack_config, topics=replace(stack_config.topics, prefix=unique_prefix))


@pytest.fixture
def publisher(topics_config, stack, tmp_path, kafka_options):
    """A real SpanPublisher on this test's own topics, installed as the SDK's sink."""
    asyncio.run(create_topics(topics_config, stack.bootstrap_servers))
    with SpanPublisher(topics_config, stack.bootstrap_servers, journal_dir=tmp_path / "journal") as running:
        set_sink(running)
        yield running
    set_sink(None)


@pytest.fixture
def private_broker(tmp_path: Path):
    """A tansu broker of this test only, on a fixed port, that the test may kill, freeze and start again."""
    broker = PrivateBroker(tmp_path / "tansu")
    broker.start()
    yield broker
    if broker.process.poll() is None:
        broker.process.send_signal(signal.SIGCONT)
        broker.kill()

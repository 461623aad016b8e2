"""Shared pieces of the benchmark scripts: JSON-line output, a private stack on either broker, a realistic 1 KB
LLM span."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentstream.infra.config import BROKERS, Config, load_config
from agentstream.infra.processes import free_port, wait_for_port
from agentstream.stack.control import Endpoints, Stack

VOCABULARY = 49152  # SmolLM2's


def emit(bench: str, metric: str, value: float | None, unit: str, **extra: Any) -> None:
    """One figure as a JSON line: {"bench", "metric", "value", "unit", ...}; a figure not reached is null."""
    print(json.dumps({"bench": bench, "metric": metric, "value": None if value is None else round(value, 3),
                      "unit": unit, **extra}), flush=True)


def add_broker_option(parser: argparse.ArgumentParser) -> None:
    """``--broker tansu|kafka|both`` (default both): the embedded broker(s) a broker-facing bench runs on, one after
    the other in one sitting, so `make bench` prints both brokers' figures side by side."""
    parser.add_argument("--broker", choices=(*BROKERS, "both"), default="both",
                        help="the private stack's broker; both: tansu, then Apache Kafka")


def chosen_brokers(choice: str) -> tuple[str, ...]:
    """The brokers ``--broker`` names, in the order they run."""
    return BROKERS if choice == "both" else (choice,)


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, value) points, per hour."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return 0.0 if spread == 0 else sum((t - mean_t) * (v - mean_v) for t, v in points) / spread * 3600


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def private_environ(home: str, **environ: str) -> dict[str, str]:
    """Settings for a stack of our own in ``home``: every service on a free loopback port, so a user's stack (or
    ``make demo``) on the default ports runs beside it."""
    return {"AGENTSTREAM_HOME": home, "AGENTSTREAM_BROKER_PORT": str(free_port()),
            "AGENTSTREAM_CLICKHOUSE_PORT": str(free_port()), "AGENTSTREAM_SCHEMA_REGISTRY_PORT": str(free_port()),
            **environ}


def cli_environ(endpoints: Endpoints, home: str, **environ: str) -> dict[str, str]:
    """This process's environment for an ``agentstream`` command over a private stack: its Kafka and ClickHouse,
    a home of its own, none of the caller's agentstream settings."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
    return {**inherited, "KAFKA_BOOTSTRAP_SERVERS": endpoints.bootstrap_servers,
            "CLICKHOUSE_URL": endpoints.clickhouse_url, "AGENTSTREAM_HOME": home, **environ}


@contextlib.contextmanager
def private_stack(**environ: str) -> Iterator[tuple[Config, Endpoints]]:
    """A stack of our own on free loopback ports, stopped afterwards."""
    with tempfile.TemporaryDirectory(prefix="agentstream-bench-") as home:
        config = load_config(environ=private_environ(home, **environ))
        stack = Stack(config)
        try:  # an `up` that fails half way has started services too: they are stopped all the same
            yield config, stack.up(progress=lambda line: None)
        finally:
            stack.down(progress=lambda line: None)


@contextlib.contextmanager
def clickhouse_front(data_dir: Path) -> Iterator[str]:
    """The embedded ClickHouse front alone (``agentstream.stack.chserver``, no password) over ``data_dir`` on a free
    loopback
    port; yields its URL, stopped afterwards."""
    port = free_port()
    command = [sys.executable, "-m", "agentstream.stack.chserver", "--port", str(port), "--data-dir", str(data_dir)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, 60, server)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def llm_span(rng: random.Random, index: int, rollout_id: str = "", start_us: int = 1_732_200_000_000_000) -> dict:
    """An LLM call of about 1 KB encoded: 100 prompt and 100 response token ids, 100 logprobs, gen_ai attributes."""
    return {
        "span_id": f"{rollout_id}-{index:08x}", "rollout_id": rollout_id, "attempt_id": f"{rollout_id}-1",
        "parent_id": None, "name": "chat SmolLM2-135M-Instruct", "kind": "LLM",
        "start_time_us": start_us + index * 1000, "end_time_us": start_us + index * 1000 + 250_000, "status": "OK",
        "agent_name": "math-agent", "task_id": f"task-{index % 7473:05d}", "model": "SmolLM2-135M-Instruct",
        "attributes": {"gen_ai.system": "agentstream", "gen_ai.request.model": "SmolLM2-135M-Instruct",
                       "gen_ai.request.temperature": "1.0", "gen_ai.usage.output_tokens": "100"},
        "prompt_token_ids": [int(VOCABULARY ** rng.random()) for _ in range(100)],
        "response_token_ids": [int(VOCABULARY ** rng.random()) for _ in range(100)],
        "response_logprobs": [-rng.expovariate(2.0) for _ in range(100)],
        "policy_version": 3,
    }


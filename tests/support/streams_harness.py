"""Run real `agentstream streams` workers against the test stack, and produce real spans for them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

from aiokafka import AIOKafkaProducer

from agentstream.infra import kafka
from agentstream.infra.config import load_config
from agentstream.infra.processes import free_port
from agentstream.schemas import ROLLOUT_EVENT, AvroCodec
from agentstream.session import Child
from agentstream.stack.control import Stack

CODEC = AvroCodec()


class CliProcess(Child):
    """An `agentstream` command in a subprocess (the product's Child), with the waits and kills tests need."""

    def __init__(self, args: list[str], env: dict, log_path: Path, cwd: Path | None = None) -> None:
        super().__init__(args[0], args, env, log_path, cwd)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert self.process.poll() is None, self.log()[-3000:]
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.log()[-3000:]}"
            time.sleep(0.1)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def exit_code(self, timeout_s: float) -> int:
        """Wait for the process to end by itself; one still running after ``timeout_s`` is stopped, failing the test."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"still running after {timeout_s:.0f} s:\n{self.log()[-3000:]}") from None


class Worker(CliProcess):
    """One streams worker process with its own log file; ``start`` returns once it is ready."""

    def __init__(self, env: dict, log_path: Path, cwd: Path | None = None) -> None:
        super().__init__(["streams"], env, log_path, cwd)

    def start(self, timeout_s: float = 60.0) -> Worker:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        super().start()
        deadline = time.monotonic() + timeout_s
        while b"Worker]: Ready" not in self.log_path.read_bytes()[offset:]:
            assert self.process.poll() is None, self.log()
            assert time.monotonic() < deadline, "worker did not become ready:\n" + self.log()[-3000:]
            time.sleep(0.2)
        return self


_WORKER_ENVS: list[dict] = []


def worker_env(tmp_path: Path, stack, prefix: str, database: str, toml: str = "") -> dict:
    """Environment for `agentstream` commands over the test stack, with a home and a registry port of their own.

    A command that brings the stack up (``train``) starts a Schema Registry there, which outlives it;
    :func:`stop_worker_stacks` stops them all at the end of the session.
    """
    config_path = tmp_path / "agentstream.toml"
    config_path.write_text(toml)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_", "SCHEMA_REGISTRY_"))}
    env.update({"KAFKA_BOOTSTRAP_SERVERS": stack.bootstrap_servers, "CLICKHOUSE_URL": stack.clickhouse_url,
                "CLICKHOUSE_DATABASE": database, "AGENTSTREAM_TOPIC_PREFIX": prefix,
                "AGENTSTREAM_CONFIG": str(config_path), "AGENTSTREAM_HOME": str(tmp_path / "home"),
                "AGENTSTREAM_SCHEMA_REGISTRY_PORT": str(free_port())})
    _WORKER_ENVS.append(env)
    return env


def stop_worker_stacks() -> None:
    """Stop what commands started under every :func:`worker_env` home (their registries)."""
    while _WORKER_ENVS:
        Stack(load_config(environ=_WORKER_ENVS.pop())).down(progress=lambda line: None)


def create_topics(env: dict) -> None:
    config = load_config(environ=env)
    asyncio.run(kafka.create_topics(config, config.kafka.bootstrap_servers))


def now_us() -> int:
    return time.time_ns() // 1000


def rollout_records(rollout_id: str, *, agent: str = "agent", task: str = "task", group: str | None = None,
                    rewards: list[tuple[int, float]] = (), llm_at: list[int] = (0,), terminal: str | None = "SUCCEEDED",
                    model: str = "m", policy_version: int = 1, tokens: bool = True, started: bool = True,
                    start_us: int | None = None, dimensions: dict[str, float] | None = None) -> list[bytes]:
    """The records of one rollout: STARTED, one SpanBatch (LLM calls at offsets in µs, rewards at offsets), terminal.

    Rewards are written as given (NaN included, as a client that skips every check would write them),
    each with ``dimensions`` as its reward dimensions.
    """
    t0 = start_us or now_us()
    attempt = f"{rollout_id}-1"
    common = {"rollout_id": rollout_id, "attempt_id": attempt, "agent_name": agent, "task_id": task,
              "group_id": group, "attributes": {}}

    def event(kind: str) -> bytes:
        return CODEC.encode(ROLLOUT_EVENT, {"rollout_id": rollout_id, "attempt_id": attempt, "event": kind,
                                            "at_us": now_us(), "task_id": task, "agent_name": agent})

    spans = [{**common, "span_id": f"{rollout_id}-llm{i}", "name": "chat", "kind": "LLM", "start_time_us": t0 + at,
              "end_time_us": t0 + at + 10, "status": "OK", "model": model, "policy_version": policy_version,
              "prompt_token_ids": [1, 2, 3, i] if tokens else None, "response_token_ids": [7, i] if tokens else None,
              "response_logprobs": [-0.5, -0.25] if tokens else None} for i, at in enumerate(llm_at)]
    spans += [{**common, "span_id": f"{rollout_id}-r{i}", "name": "reward", "kind": "REWARD", "start_time_us": t0 + at,
               "end_time_us": t0 + at, "status": "OK", "reward": value, "reward_dimensions": dimensions}
              for i, (at, value) in enumerate(rewards)]
    records = [event("STARTED")] if started else []
    records.append(CODEC.encode_span_batch(spans))
    if terminal:
        records.append(event(terminal))
    return records


async def produce(bootstrap: str, topic: str, items: list[tuple[bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        for key, value in items:
            await producer.send(topic, key=key, value=value)
        await producer.flush()
    finally:
        await producer.stop()


def wait_for(check, timeout_s: float = 60.0, interval_s: float = 0.3, what: str = "condition", equals=None,
             process: CliProcess | None = None):
    """Poll ``check()`` until it is truthy (or equals ``equals`` when given); fail with the last value seen
    (and the end of ``process``'s log, when given, so a failure in CI says what the process was doing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if (value == equals) if equals is not None else value:
            return value
        if time.monotonic() > deadline:
            tail = "" if process is None else f"\n{process.log_path.name}:\n{process.log()[-6000:]}"
            raise AssertionError(f"timed out waiting for {what}; last value {value!r}{tail}")
        time.sleep(interval_s)

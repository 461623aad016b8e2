"""The SDK and the runner against the real broker: attribution across tasks and threads, retries, timeouts."""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import time

import pytest

from agentstream.infra.kafka import topic_name
from agentstream.pipeline.runner.pool import Runner, RunnerOptions
from agentstream.pipeline.runner.tasks import enqueue, make_task
from agentstream.pipeline.sdk import (
    NoRollout,
    emit_message,
    emit_object,
    emit_reward,
    rollout,
    span,
)
from tests.support.readback import read_topic


def _spans_topic(config) -> str:
    return topic_name(config.topics, "spans")


def test_sdk_attributes_spans_across_threads_and_tasks(publisher, topics_config, kafka_options):
    async def agent_step(label: str) -> None:
        async with span("plan", kind="AGENT", label=label):
            await asyncio.sleep(0.01)
            emit_message(f"thinking {label}")

    def in_thread() -> None:
        with span("tool", kind="TOOL", tool="calculator"):
            emit_object({"result": 42})

    async def main() -> list[str]:
        ids = []
        for name in ("a", "b"):
            async with rollout("math-agent", task_id=f"task-{name}") as state:
                ids.append(state.rollout_id)
                await asyncio.gather(agent_step(name), agent_step(name + "2"))
                context = contextvars.copy_context()
                worker = threading.Thread(target=context.run, args=(in_thread,))
                worker.start()
                worker.join()
                emit_reward({"correct": 1.0, "format": 0.5}, primary="correct")
                emit_reward(0.25)
        return ids

    ids = asyncio.run(main())
    publisher.flush(10)
    landed = read_topic(kafka_options, _spans_topic(topics_config),
                        lambda got: sum(1 for e in got.events if e["event"] == "SUCCEEDED") >= 2)
    for rollout_id, task in zip(ids, ("task-a", "task-b"), strict=True):
        spans, events = landed.of(rollout_id)
        assert [e["event"] for e in events] == ["STARTED", "SUCCEEDED"]
        kinds = sorted(s["kind"] for s in spans)
        assert kinds == sorted(["AGENT", "AGENT", "AGENT", "MESSAGE", "MESSAGE", "TOOL", "OBJECT", "REWARD", "REWARD"])
        root = next(s for s in spans if s["parent_id"] is None)
        assert root["kind"] == "AGENT" and root["name"] == "math-agent"
        by_id = {s["span_id"]: s for s in spans}
        for message in (s for s in spans if s["kind"] == "MESSAGE"):
            assert by_id[message["parent_id"]]["name"] == "plan", "emitted inside a span: that span is the parent"
        tool = next(s for s in spans if s["kind"] == "TOOL")
        assert tool["parent_id"] == root["span_id"] and tool["attributes"]["tool"] == "calculator"
        assert next(s for s in spans if s["kind"] == "OBJECT")["parent_id"] == tool["span_id"]
        rewards = [s for s in spans if s["kind"] == "REWARD"]
        assert [r["reward"] for r in sorted(rewards, key=lambda r: r["start_time_us"])] == [1.0, 0.25]
        assert any(r["reward_dimensions"] == {"correct": 1.0, "format": 0.5} for r in rewards)
        assert all(s["task_id"] == task and s["agent_name"] == "math-agent" for s in spans)


def test_emitting_outside_a_rollout_is_a_clear_error(publisher):
    with pytest.raises(NoRollout, match="outside a rollout"):
        emit_reward(1.0)


def test_failed_rollout_records_the_exception(publisher, topics_config, kafka_options):
    with pytest.raises(ZeroDivisionError), rollout("fragile") as state:
        _ = 1 / 0
    publisher.flush(10)
    landed = read_topic(kafka_options, _spans_topic(topics_config),
                        lambda got: any(e["event"] == "FAILED" for e in got.events))
    spans, events = landed.of(state.rollout_id)
    assert [e["event"] for e in events] == ["STARTED", "FAILED"]
    assert "ZeroDivisionError" in events[-1]["error"]
    exception = next(s for s in spans if s["kind"] == "EXCEPTION")
    assert exception["status"] == "ERROR" and exception["attributes"]["exception.type"] == "ZeroDivisionError"


def test_a_rollouts_training_choice_is_on_every_span_it_publishes(publisher, topics_config, kafka_options):
    """train=False/True reaches the spans topic on every span, the root and the exception included; None adds none."""
    ids = {}
    for train in (False, True, None):
        with pytest.raises(ValueError), rollout("chooser", train=train) as state:
            ids[train] = state.rollout_id
            with span("step", kind="TOOL"):
                emit_message("hello")
            emit_reward(1.0)
            raise ValueError("after the reward")
    publisher.flush(10)
    landed = read_topic(kafka_options, _spans_topic(topics_config),
                        lambda got: sum(1 for e in got.events if e["event"] == "FAILED"
                                        and e["rollout_id"] in ids.values()) >= 3)
    for train, expected in ((False, "false"), (True, "true"), (None, None)):
        spans, _ = landed.of(ids[train])
        assert sorted(s["kind"] for s in spans) == ["AGENT", "EXCEPTION", "MESSAGE", "REWARD", "TOOL"]
        assert [s["attributes"].get("agentstream.train") for s in spans] == [expected] * 5


def flaky_agent(task: dict, state) -> float:
    """Fails on the first attempt of odd tasks, sleeps past the timeout on 'slow', else returns a reward."""
    with span("work", kind="TOOL"):
        if task["n"] % 2 and state.attempt == 1:
            raise RuntimeError(f"flaky {task['n']}")
        if task.get("slow") and state.attempt == 1:
            time.sleep(3)
    return task["n"] / 10


async def async_agent(task: dict) -> float:
    async with span("work"):
        await asyncio.sleep(0.01)
    emit_reward(0.5)
    return 1.0


def test_runner_retries_failures_and_timeouts(publisher, topics_config, stack, kafka_options):
    tasks = [make_task({"n": n}, max_attempts=2, timeout_s=2.0, agent_name="flaky") for n in range(6)]
    tasks.append(make_task({"n": 10, "slow": True}, max_attempts=2, timeout_s=1.0, agent_name="flaky"))
    asyncio.run(enqueue(topics_config, stack.bootstrap_servers, tasks))
    runner = Runner(flaky_agent, topics_config, stack.bootstrap_servers, publisher,
                    RunnerOptions(concurrency=3, group_id="runners-retry", heartbeat_s=0.5, session_timeout_ms=3000))
    stats = asyncio.run(asyncio.wait_for(runner.run(max_tasks=len(tasks) + 4), 90))
    publisher.flush(10)
    assert (stats.succeeded, stats.failed, stats.timed_out, stats.retried) == (7, 3, 1, 4)

    landed = read_topic(kafka_options, _spans_topic(topics_config),
                        lambda got: sum(1 for e in got.events if e["event"] == "SUCCEEDED") >= 7)
    for task in tasks:
        spans, events = landed.of(task["rollout_id"])
        terminal = [e["event"] for e in events if e["event"] != "HEARTBEAT" and e["event"] != "STARTED"]
        n = json.loads(task["input"])["n"]
        if n % 2 or n == 10:
            assert terminal == ["FAILED" if n % 2 else "TIMED_OUT", "SUCCEEDED"]
            assert len({e["attempt_id"] for e in events}) == 2, "a retry is a new attempt of the same rollout"
        else:
            assert terminal == ["SUCCEEDED"]
        final = [s for s in spans if s["kind"] == "REWARD"]
        assert [r["reward"] for r in final] == [n / 10]
    slow_events = landed.of(tasks[-1]["rollout_id"])[1]
    assert any(e["event"] == "HEARTBEAT" for e in slow_events), "a long rollout sends heartbeats"


def test_runner_runs_async_agents(publisher, topics_config, stack, kafka_options):
    tasks = [make_task({"i": i}, agent_name="async") for i in range(4)]
    asyncio.run(enqueue(topics_config, stack.bootstrap_servers, tasks))
    runner = Runner(async_agent, topics_config, stack.bootstrap_servers, publisher,
                    RunnerOptions(concurrency=4, group_id="runners-async", session_timeout_ms=3000))
    stats = asyncio.run(asyncio.wait_for(runner.run(max_tasks=4), 60))
    publisher.flush(10)
    assert stats.succeeded == 4
    landed = read_topic(kafka_options, _spans_topic(topics_config),
                        lambda got: sum(1 for e in got.events if e["event"] == "SUCCEEDED") >= 4)
    for task in tasks:
        spans, _ = landed.of(task["rollout_id"])
        assert sorted(s["reward"] for s in spans if s["kind"] == "REWARD") == [0.5, 1.0]


def test_a_crashed_runners_rollout_is_retried_by_another(topics_config, stack, kafka_options, tmp_path, publisher):
    import os
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
    env.update({"KAFKA_BOOTSTRAP_SERVERS": stack.bootstrap_servers, "CLICKHOUSE_URL": stack.clickhouse_url,
                "AGENTSTREAM_TOPIC_PREFIX": topics_config.topics.prefix, "AGENTSTREAM_HOME": str(tmp_path / "h")})
    command = [sys.executable, "-m", "agentstream", "run", "tests.support.agents:slow_agent",
               "--group", "crash-runners", "--session-timeout-ms", "3000"]
    task = make_task({"sleep": 4}, agent_name="slow", max_attempts=1, timeout_s=30)
    asyncio.run(enqueue(topics_config, stack.bootstrap_servers, [task]))
    spans_topic = _spans_topic(topics_config)
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        read_topic(kafka_options, spans_topic, lambda got: bool(got.of(task["rollout_id"])[1]), timeout_s=60)
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = subprocess.Popen([*command, "--max-tasks", "1"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        output, _ = second.communicate(timeout=90)
        assert second.returncode == 0 and "1 succeeded" in output, output
    finally:
        if first.poll() is None:
            first.kill()
    landed = read_topic(kafka_options, spans_topic,
                        lambda got: any(e["event"] == "SUCCEEDED" for e in got.of(task["rollout_id"])[1]))
    events = landed.of(task["rollout_id"])[1]
    started = [e for e in events if e["event"] == "STARTED"]
    succeeded = [e for e in events if e["event"] == "SUCCEEDED"]
    assert len(started) == 2 and len(succeeded) == 1
    assert started[0]["attempt_id"] != succeeded[0]["attempt_id"] == started[1]["attempt_id"]
    assert started[0]["worker_id"] != started[1]["worker_id"]

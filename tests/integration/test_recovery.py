"""Recovery and shutdown bounds: a restarted stream worker is processing again within seconds of its start, and
SIGTERM ends a worker, a runner and a trainer within their configured grace even with the broker gone.

Measured before: a restarted worker waited out the dead member's session (19-21 s with faust's defaults), and a
worker SIGTERMed with the broker down logged NodeNotReadyError/CancelledError and was still running after 70 s.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import load_config
from agentstream.infra.kafka import create_topics, topic_name
from agentstream.pipeline.runner.tasks import enqueue, make_task
from agentstream.stack.machine import calibrate
from tests.support.broker import MemoryBroker
from tests.support.streams_harness import CliProcess, Worker, produce, rollout_records, wait_for, worker_env

GRACE_S = 3.0
RESTART_BOUND_S = 5.0  # set on the 2-core Xeon of docs/measured.md, `python_loop_s` 0.22-0.25
REFERENCE_PYTHON_LOOP_S = 0.25
CONFIG = """
[streams]
app_id = "{app_id}"
grace_s = 0.2
idle_timeout_s = 1.5
shutdown_grace_s = {grace}

[runner]
shutdown_grace_s = {grace}

[trainer]
model = "tiny"
model_name = "tiny-{tag}"
device = "cpu"
threads = 1
checkpoint_dir = "{checkpoints}"
shutdown_grace_s = {grace}

[[credit]]
agent = "*"
strategy = "final"
"""


def _env(tmp_path, stack, tag: str, **overrides: str) -> dict:
    toml = CONFIG.format(app_id=f"recovery-{tag}", grace=GRACE_S, tag=tag, checkpoints=tmp_path / "checkpoints")
    env = worker_env(tmp_path, stack, f"v{tag}.", f"recovery_{tag}", toml)
    env.update(overrides)
    return env


def test_a_sigkilled_worker_restarted_processes_a_new_record_within_a_scaled_5_s(tmp_path, stack, stack_config):
    tag = uuid.uuid4().hex[:8]
    env = _env(tmp_path, stack, tag)
    config = load_config(environ=env)
    asyncio.run(create_topics(config, stack.bootstrap_servers))
    topic, database = topic_name(config.topics, "spans"), f"recovery_{tag}"
    client = connect(stack_config.clickhouse, stack.clickhouse_url)

    def stored(rollout_id: str) -> int:
        return client.query(f"SELECT count() FROM {database}.spans FINAL WHERE rollout_id = '{rollout_id}'"
                            ).result_rows[0][0]

    def publish(rollout_id: str) -> None:
        asyncio.run(produce(stack.bootstrap_servers, topic,
                            [(rollout_id.encode(), value) for value in rollout_records(rollout_id)]))

    worker = Worker(env, tmp_path / "worker.log").start()
    try:
        publish("first")
        wait_for(lambda: stored("first"), 30, what="the first rollout stored")
        # the machine's speed drifts (1.7x within a day here): the bound scales with how slow it runs Python now
        bound = RESTART_BOUND_S * max(1.0, calibrate().python_loop_s / REFERENCE_PYTHON_LOOP_S)
        worker.kill()
        started = time.monotonic()
        worker = Worker(env, tmp_path / "worker.log")
        worker.start()
        publish("second")
        wait_for(lambda: stored("second"), 30, interval_s=0.05, what="the second rollout stored")
        seconds = time.monotonic() - started
        print(f'{{"metric": "worker_restart_to_processing_s", "value": {seconds:.2f}, "bound": {bound:.2f}}}')
        assert seconds <= bound
    finally:
        worker.stop()
        client.command(f"DROP DATABASE IF EXISTS {database}")
        client.close()


def test_sigterm_with_the_broker_gone_ends_worker_runner_and_trainer_within_their_grace(tmp_path, stack):
    tag = uuid.uuid4().hex[:8]
    broker = MemoryBroker(tmp_path).start()
    env = _env(tmp_path, stack, tag, KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap_servers)
    config = load_config(environ=env)
    processes: dict[str, CliProcess] = {}
    try:
        asyncio.run(create_topics(config, broker.bootstrap_servers))
        # a rollout that is still running when the runner is told to stop: it must be abandoned, not waited for
        asyncio.run(enqueue(config, broker.bootstrap_servers, [make_task({"sleep": 120}, timeout_s=300)]))
        processes["worker"] = Worker(env, tmp_path / "worker.log").start()
        processes["runner"] = CliProcess(["run", "tests.support.agents:slow_agent", "--session-timeout-ms", "3000"],
                                         env, tmp_path / "runner.log").start()
        processes["trainer"] = CliProcess(["train-worker"], env, tmp_path / "trainer.log").start()
        processes["runner"].wait_for("in group")
        processes["trainer"].wait_for("no checkpoint yet")
        time.sleep(3)  # all three consuming (the runner's rollout has started)
        broker.kill()
        time.sleep(1)
        sent = time.monotonic()
        for process in processes.values():
            assert process.process is not None
            process.process.send_signal(signal.SIGTERM)
        exits: dict[str, float] = {}
        while len(exits) < len(processes) and time.monotonic() - sent < GRACE_S + 10:
            for name, process in processes.items():
                if name not in exits and process.process.poll() is not None:
                    exits[name] = round(time.monotonic() - sent, 2)
            time.sleep(0.05)
        print({"grace_s": GRACE_S, "exit_s": exits})
        for name, process in processes.items():
            assert name in exits, f"{name} still running {GRACE_S + 10} s after SIGTERM:\n{process.log()[-3000:]}"
            assert exits[name] <= GRACE_S + 1, f"{name} took {exits[name]} s:\n{process.log()[-3000:]}"
    finally:
        for process in processes.values():
            if process.running:
                process.kill()
        broker.kill()

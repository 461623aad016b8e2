"""``agentstream train``: train an agent on a task file with one command, the way Agent Lightning users do.

Enqueues every task (``group_size`` rollouts each, for GRPO), starts a training session
(model server unless one is given, proxy, streams, trainer, hot swap, runners), prints progress
until every rollout has finished and the trainer has caught up, then stops the session. The
stack stays up, so the run can be queried afterwards with ``agentstream sql`` / ``report``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from pathlib import Path

from agentstream.session import SessionPlan, TrainingSession
from infra.clickhouse import connect
from infra.config import Config, CreditRule
from infra.stack import Stack
from models import model_display_name
from pipeline.tasks import enqueue, grouped_tasks, read_task_file


@dataclass(frozen=True)
class TrainRequest:
    """What ``agentstream train`` was asked to do."""

    agent: str
    tasks: Path
    agent_name: str
    model: str = "smollm2"
    server_url: str | None = None
    runners: int = 1
    concurrency: int = 8
    group_size: int = 8
    strategy: str = "grpo"
    epochs: int = 1
    max_steps: int | None = None
    timeout_s: float = 300.0


@dataclass
class TrainSummary:
    rollouts: int
    steps: int
    policy_version: int
    reward_first: float | None
    reward_last: float | None
    seconds: float


def session_config(config: Config, request: TrainRequest, workdir: Path) -> Config:
    """The user's configuration with this run's agent selected for training under the chosen strategy."""
    rule = CreditRule(agent=request.agent_name, strategy=request.strategy, group_size=request.group_size)
    return replace(config, credit=(rule, *config.credit),
                   trainer=replace(config.trainer, model=request.model,
                                   checkpoint_dir=config.trainer.checkpoint_dir or str(workdir / "checkpoints")))


def _progress(client, agent_name: str, since_us: int) -> tuple[int, int, int, float | None, float | None]:
    rollouts = client.query(
        "SELECT count() FROM rollouts FINAL WHERE agent_name = {agent:String} "
        "AND start_time >= fromUnixTimestamp64Micro({since:Int64}) AND status NOT IN ('RUNNING', 'AWAITING_REWARD')",
        parameters={"agent": agent_name, "since": since_us}).result_rows[0][0]
    steps, version, first, last = client.query(
        "SELECT count(), max(policy_version) + 1, argMin(reward_mean, step), argMax(reward_mean, step) "
        "FROM train_steps FINAL WHERE created_at >= fromUnixTimestamp64Micro({since:Int64})",
        parameters={"since": since_us}).result_rows[0]
    return rollouts, steps, version if steps else 0, first if steps else None, last if steps else None


def run_training(config: Config, request: TrainRequest, progress=print) -> TrainSummary:
    """Run one training session over the task file; returns what it did."""
    payloads = read_task_file(request.tasks)
    if not payloads:
        raise ValueError(f"{request.tasks}: no tasks")
    started = time.monotonic()
    since_us = time.time_ns() // 1000
    workdir = config.stack.home.resolve() / "train" / time.strftime("%Y%m%d-%H%M%S")
    config = session_config(config, request, workdir)
    endpoints = Stack(config).up(progress=progress)
    tasks = grouped_tasks(payloads * request.epochs, group_size=request.group_size if request.strategy == "grpo" else 1,
                          agent_name=request.agent_name, timeout_s=request.timeout_s)
    asyncio.run(enqueue(config, endpoints.bootstrap_servers, tasks))
    progress(f"enqueued {len(tasks)} rollouts ({len(payloads)} tasks x {request.epochs} epochs"
             + (f" x {request.group_size} per group)" if request.strategy == "grpo" else ")"))
    session = TrainingSession(config, endpoints, workdir, SessionPlan(
        agent=request.agent, model=request.model, runners=request.runners, concurrency=request.concurrency,
        server_url=request.server_url, server_threads=config.trainer.threads))
    client = connect(config.clickhouse, endpoints.clickhouse_url, database=config.clickhouse.database, readonly=True)
    try:
        session.start(progress=progress)
        session.start_runners(progress=progress)
        idle_since, last_steps = time.monotonic(), 0
        while True:
            session.check()
            time.sleep(5)
            rollouts, steps, version, first, last = _progress(client, request.agent_name, since_us)
            progress(f"[{time.monotonic() - started:5.0f}s] rollouts {rollouts}/{len(tasks)}, optimizer steps {steps}, "
                     f"policy v{version}" + (f", reward {first:.3f} -> {last:.3f}" if steps else ""))
            if steps != last_steps:
                idle_since, last_steps = time.monotonic(), steps
            if request.max_steps is not None and steps >= request.max_steps:
                break
            caught_up = time.monotonic() - idle_since > config.trainer.batch_wait_s + 10
            if rollouts >= len(tasks) and caught_up:
                break
    finally:
        session.stop()
    rollouts, steps, version, first, last = _progress(client, request.agent_name, since_us)
    client.close()
    progress(f"done: {rollouts} rollouts, {steps} optimizer steps, {model_display_name(request.model)} now at "
             f"v{version}; logs in {workdir}")
    return TrainSummary(rollouts, steps, version, first, last, round(time.monotonic() - started, 1))

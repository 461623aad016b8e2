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

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import Config, CreditRule
from agentstream.models import model_display_name
from agentstream.pipeline.runner.tasks import TaskFileError, enqueue, grouped_tasks, read_task_file
from agentstream.session import SessionPlan, TrainingSession
from agentstream.stack.control import Stack


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
    val_tasks: Path | None = None

    @property
    def eval_agent_name(self) -> str:
        """Evaluation rollouts run under this name (never trained on), as the demo's ``-eval`` agent does."""
        return f"{self.agent_name}-eval"


@dataclass
class TrainSummary:
    rollouts: int
    steps: int
    policy_version: int
    reward_first: float | None
    reward_last: float | None
    seconds: float
    val_before: float | None = None
    val_after: float | None = None


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


def _evaluation(client, request: TrainRequest, since_us: int) -> tuple[int, float | None]:
    """Finished evaluation rollouts since ``since_us`` and their mean final reward."""
    finished, mean = client.query(
        "SELECT countIf(status NOT IN ('RUNNING', 'AWAITING_REWARD')), avgIf(final_reward, final_reward IS NOT NULL) "
        "FROM rollouts FINAL WHERE agent_name = {agent:String} "
        "AND start_time >= fromUnixTimestamp64Micro({since:Int64})",
        parameters={"agent": request.eval_agent_name, "since": since_us}).result_rows[0]
    return int(finished), None if mean is None or mean != mean else float(mean)


def _validation_tasks(request: TrainRequest, payloads: list) -> list:
    return grouped_tasks(payloads, group_size=1, agent_name=request.eval_agent_name, timeout_s=request.timeout_s,
                         metadata={"mode": "val"})


def _validate(config: Config, endpoints, client, request: TrainRequest, payloads: list, progress,
              timeout_s: float = 600.0) -> float | None:
    """Run the evaluation tasks on the current policy and wait for them; returns their mean reward."""
    since_us = time.time_ns() // 1000
    asyncio.run(enqueue(config, endpoints.bootstrap_servers, _validation_tasks(request, payloads)))
    deadline = time.monotonic() + timeout_s
    while True:
        finished, mean = _evaluation(client, request, since_us)
        if finished >= len(payloads) or time.monotonic() > deadline:
            return mean
        time.sleep(2)


def run_training(config: Config, request: TrainRequest, progress=print) -> TrainSummary:
    """Run one training session over the task file; returns what it did."""
    payloads = read_task_file(request.tasks)
    if not payloads:
        raise TaskFileError(f"{request.tasks}: no tasks")
    val_payloads = read_task_file(request.val_tasks) if request.val_tasks else []
    if request.val_tasks and not val_payloads:
        raise TaskFileError(f"{request.val_tasks}: no tasks")
    started = time.monotonic()
    since_us = time.time_ns() // 1000
    workdir = config.stack.home.resolve() / "train" / time.strftime("%Y%m%d-%H%M%S")
    config = session_config(config, request, workdir)
    endpoints = Stack(config).up(progress=progress)
    tasks = grouped_tasks(payloads * request.epochs, group_size=request.group_size if request.strategy == "grpo" else 1,
                          agent_name=request.agent_name, timeout_s=request.timeout_s)
    if val_payloads:  # the baseline evaluation goes first in the queue
        asyncio.run(enqueue(config, endpoints.bootstrap_servers, _validation_tasks(request, val_payloads)))
        progress(f"enqueued {len(val_payloads)} evaluation rollouts as {request.eval_agent_name} (before training)")
    asyncio.run(enqueue(config, endpoints.bootstrap_servers, tasks))
    progress(f"enqueued {len(tasks)} rollouts ({len(payloads)} tasks x {request.epochs} epochs"
             + (f" x {request.group_size} per group)" if request.strategy == "grpo" else ")"))
    session = TrainingSession(config, endpoints, workdir, SessionPlan(
        agent=request.agent, model=request.model, runners=request.runners, concurrency=request.concurrency,
        server_url=request.server_url, server_threads=config.trainer.threads))
    client = connect(config.clickhouse, endpoints.clickhouse_url, database=config.clickhouse.database, readonly=True)
    val_before = val_after = None
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
        if val_payloads:
            val_before = _evaluation(client, request, since_us)[1]
            progress(f"evaluating {len(val_payloads)} tasks as {request.eval_agent_name} on the trained policy")
            val_after = _validate(config, endpoints, client, request, val_payloads, progress)
    finally:
        session.stop()
    rollouts, steps, version, first, last = _progress(client, request.agent_name, since_us)
    client.close()
    progress(f"done: {rollouts} rollouts, {steps} optimizer steps, {model_display_name(request.model)} now at "
             f"v{version}; logs in {workdir}")
    summary = TrainSummary(rollouts, steps, version, first, last, round(time.monotonic() - started, 1))
    if val_payloads:
        summary.val_before, summary.val_after = val_before, val_after
        progress(f"evaluation ({request.eval_agent_name}, {len(val_payloads)} tasks): mean reward "
                 f"{_number(val_before)} before training, {_number(val_after)} after")
    return summary


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"

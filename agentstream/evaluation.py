"""The gate's evaluation: the configured evaluation agent run through the proxy over the evaluation tasks.

The gate (``deploy/gate.py``) only decides; here it gets its evaluation: the evaluation agent
run over the evaluation tasks as rollouts of :data:`GATE_AGENT` through the proxy, each task's
``model`` naming the pinned version, every rollout opted out of training. It runs agents, so it
sits above both ``deploy`` and ``pipeline``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any

from agentstream.deploy.deployments import DeploymentError, adapter_name
from agentstream.deploy.gate import GATE_AGENT, Evaluate, EvaluationError, Score
from agentstream.infra.config import Config
from agentstream.pipeline.proxy.access import proxy_client_key
from agentstream.pipeline.runner.pool import call_agent, load_agent
from agentstream.pipeline.runner.tasks import read_task_file
from agentstream.pipeline.sdk import SpanSink, emit_reward, rollout

log = logging.getLogger("agentstream.gate")

EVAL_ATTEMPTS = 3
"""Tries per evaluation task before the evaluation fails (a call that errs is retried, never scored 0)."""
EVAL_RETRY_S = 1.0
"""The pause before the second try; it grows by this much each time."""


def task_evaluator(config: Config, proxy_url: str, model: str, sink: SpanSink) -> Evaluate:
    """Score a version: the reward of ``deploy.eval_agent`` on each of ``deploy.eval_tasks``, pinned to that version.

    A task whose call fails or returns no finite number is tried :data:`EVAL_ATTEMPTS` times;
    if it still fails the whole evaluation raises :class:`EvaluationError` (the gate judges nothing on it).
    """
    settings = config.deploy
    if not settings.eval_agent or not settings.eval_tasks:
        raise DeploymentError("the gate needs an evaluation: set [deploy] eval_agent (module:function) and "
                              "eval_tasks (a JSONL task file)")
    agent = load_agent(settings.eval_agent)
    tasks = read_task_file(Path(settings.eval_tasks))
    tasks = tasks[:settings.eval_limit] if settings.eval_limit else tasks
    if not tasks:
        raise DeploymentError(f"the evaluation task file {settings.eval_tasks} holds no task")
    proxy_key = proxy_client_key(config)

    async def evaluate(version: int) -> Score:
        pinned = adapter_name(model, version) if version else model
        slots = asyncio.Semaphore(settings.eval_concurrency)

        async def attempt(task: dict[str, Any]) -> float:
            async with rollout(GATE_AGENT, task_id=str(task.get("id", "")) or None, proxy_url=proxy_url,
                               proxy_key=proxy_key, sink=sink, train=False) as state:
                result = await call_agent(agent, {**task, "model": pinned}, state)
                if not isinstance(result, (int, float)) or not math.isfinite(result):
                    raise EvaluationError(f"the evaluation agent returned {result!r}, not a finite reward")
                emit_reward(float(result))
                return float(result)

        async def one(task: dict[str, Any]) -> float:
            async with slots:
                for tried in range(1, EVAL_ATTEMPTS):
                    try:
                        return await attempt(task)
                    except Exception as error:  # a failed call scores nothing: it is tried again
                        log.warning("evaluation of %s on task %s failed (try %d of %d): %s", pinned, task.get("id"),
                                    tried, EVAL_ATTEMPTS, error)
                        await asyncio.sleep(EVAL_RETRY_S * tried)
                try:
                    return await attempt(task)
                except Exception as error:
                    raise EvaluationError(f"task {task.get('id')!r} on {pinned} failed {EVAL_ATTEMPTS} times, last: "
                                          f"{error}") from error

        outcomes = await asyncio.gather(*(one(task) for task in tasks), return_exceptions=True)
        rewards = [outcome for outcome in outcomes if isinstance(outcome, float)]
        if len(rewards) < len(tasks):
            first = next(outcome for outcome in outcomes if not isinstance(outcome, float))
            raise EvaluationError(f"{len(tasks) - len(rewards)} of {len(tasks)} evaluation tasks failed; "
                                  f"first: {first}")
        return Score(tuple(rewards))

    return evaluate

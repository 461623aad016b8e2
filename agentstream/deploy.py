"""Deployment control: the gate's evaluation through the proxy, and what ``deployments``/``promote``/``rollback`` do.

The gate itself (``trainer/gate.py``) only decides; here it gets its evaluation: the configured
evaluation agent run over the evaluation tasks as rollouts of :data:`GATE_AGENT` through the
proxy, each task's ``model`` naming the pinned version, every rollout opted out of training.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.config import Config
from infra.deployments import Action, Decision, DeploymentError, DeploymentLog, Routing, adapter_name, decide
from pipeline.access import proxy_client_key
from pipeline.runner import call_agent, load_agent
from pipeline.sdk import SpanSink, emit_reward, rollout
from pipeline.tasks import read_task_file
from trainer.gate import GATE_AGENT, Evaluate, EvaluationError, Score

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


@dataclass(frozen=True)
class CheckpointInfo:
    """What the checkpoints table knows of one version."""

    uri: str
    format: str


def checkpoint_info(warehouse: Any, database: str, model: str, version: int) -> CheckpointInfo:
    rows = warehouse.query(f"SELECT uri, format FROM {database}.checkpoints FINAL "
                           "WHERE model = {model:String} AND version = {version:Int64}",
                           parameters={"model": model, "version": version}).result_rows
    if not rows:
        raise DeploymentError(f"model {model!r} has no checkpoint v{version} (see: agentstream sql "
                              f"\"SELECT version FROM checkpoints WHERE model = '{model}'\")")
    return CheckpointInfo(rows[0][0], rows[0][1])


def promotion(routing: Routing, version: int, info: CheckpointInfo | None) -> Decision:
    """A person's promotion of ``version`` (0: the base model) to all traffic, ending any canary or candidate."""
    if version == 0 and routing.format == "full":
        raise DeploymentError("full-weight deployments cannot go back to the base model by promotion: "
                              "promote a checkpoint")
    return decide(routing, version, Action.PROMOTED, "manual", "promoted by hand (agentstream promote)",
                  stable_version=version, stable_uri=info.uri if info else "",
                  format=info.format if info else routing.format, canary_version=None, canary_share=0.0,
                  candidate_version=None)


def rollback(routing: Routing, previous: tuple[int, str] | None) -> Decision:
    """A person's rollback: end the canary if one runs, else put the version that served before the stable back."""
    if routing.canary_version is not None:
        return decide(routing, routing.canary_version, Action.ROLLED_BACK, "manual",
                      "canary ended by hand (agentstream rollback)", canary_version=None, canary_share=0.0)
    if previous is None:
        raise DeploymentError(f"{routing.model}: nothing to roll back to (no version served before "
                              f"v{routing.stable_version})")
    version, uri = previous
    return decide(routing, routing.stable_version, Action.ROLLED_BACK, "manual",
                  f"rolled back by hand to v{version} (agentstream rollback)", stable_version=version,
                  stable_uri=uri, candidate_version=None)


def previous_stable(warehouse: Any, database: str, routing: Routing) -> tuple[int, str] | None:
    """The stable version (and its URI) in force before the current one, from the decisions table.

    Before a model's first decision its base model served, so that is what a LoRA deployment
    goes back to when no earlier stable version is recorded.
    """
    rows = warehouse.query(
        f"SELECT stable_version, argMax(decision_id, decided_at) FROM {database}.deployments FINAL "
        "WHERE model = {model:String} AND stable_version != {current:Int64} "
        "GROUP BY stable_version ORDER BY max(decided_at) DESC LIMIT 1",
        parameters={"model": routing.model, "current": routing.stable_version}).result_rows
    if not rows:
        return (0, "") if routing.stable_version and routing.format == "lora" else None
    version = int(rows[0][0])
    if version == 0:
        return 0, ""
    return version, checkpoint_info(warehouse, database, routing.model, version).uri


async def record_decision(config: Config, bootstrap_servers: str, warehouse: Any, decision: Decision) -> None:
    log_ = DeploymentLog(config, bootstrap_servers, warehouse)
    await log_.start()
    try:
        await log_.record(decision)
    finally:
        await log_.stop()


RECENT_DECISIONS_SQL = """
SELECT decided_at, model, version, action, decided_by, reason
FROM {database}.deployments FINAL
WHERE {model:String} = '' OR model = {model:String}
ORDER BY decided_at DESC
LIMIT {limit:UInt32}
"""

"""The promotion gate: a new checkpoint is a candidate until an evaluation, a canary and a promotion decide.

For each new checkpoint of its model the gate (one process per trained model):

1. announces it as a CANDIDATE (hot swap loads it; no user is routed to it) and waits until
   the server lists it;
2. scores it and the stable version with ``evaluate`` (the configured evaluation agent over
   held-out tasks, pinned to each version; both scored afresh for every candidate) and lets it
   on only when the data show it is no worse than the stable version by more than
   ``deploy.tolerance``: the lower ``deploy.confidence`` bound of the mean paired difference
   (candidate - stable, task by task; :func:`agentstream.deploy.sequential.paired_lower_bound`) is above
   ``-deploy.tolerance``. The same test runs against the best-scoring version that has served
   all traffic (of those this gate process has scored, scored again now), so a run of
   candidates each a little worse than the one before cannot slide below the best by more than
   the tolerance one step at a time. An evaluation that fails (a task that errs or returns no
   finite reward after its retries) judges nothing: the candidate is REJECTED as "evaluation
   failed", with the error;
3. makes it the CANARY for ``deploy.canary_share`` of live rollouts and watches the live
   rewards of both versions in ClickHouse's ``rollouts`` table since the canary began, every
   ``poll_s``: the always-valid bound of :mod:`agentstream.deploy.sequential` (a normal-mixture sequential
   test, valid however often it is looked at) PROMOTES it once the data show it is no worse than
   the tolerance (and ``canary_min_s`` has passed) and ROLLS it BACK once they show it is worse.
   Each wrong decision has probability at most 1 - ``deploy.confidence``. A canary still
   undecided at ``canary_max_s`` is rolled back: never promoted on a lack of evidence.

Neither bound is computed on fewer than ``deploy.canary_min_rollouts`` rewarded canary
rollouts (and two stable ones). Checkpoints that arrive while one is being considered wait;
when the gate is free it takes the newest and marks the ones in between SUPERSEDED. A
person's decision (``agentstream promote``/``rollback``) that changes the candidate or canary
ends the gate's consideration. The gate announces itself on the deployments topic
(:func:`agentstream.deploy.deployments.announce`) and refuses to run beside a hot swap that promotes
every checkpoint itself (``deploy.gate = false``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from agentstream.deploy.checkpoint_follower import CheckpointFollower
from agentstream.deploy.deployments import (
    Action,
    Decision,
    DeploymentFollower,
    DeploymentLog,
    Routing,
    adapter_name,
    announce,
    decide,
)
from agentstream.deploy.sequential import Verdict, canary_bounds, canary_verdict, paired_differences, paired_lower_bound
from agentstream.infra.clickhouse import ROLLOUT_POLICY_VERSION
from agentstream.infra.config import Config
from agentstream.schemas.checkpoint import Checkpoint
from agentstream.schemas.errors import AgentstreamError

log = logging.getLogger("agentstream.gate")

GATE_AGENT = "agentstream-gate"
"""The agent name of evaluation rollouts: they never train (opted out) and never count as live traffic."""


class EvaluationError(AgentstreamError, RuntimeError):
    """An evaluation could not score a version (a task failed after its retries): nothing is judged on it."""


@dataclass(frozen=True)
class Score:
    """An evaluation: the reward on each evaluation task, in task order."""

    rewards: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0

    @property
    def tasks(self) -> int:
        return len(self.rewards)


Evaluate = Callable[[int], Awaitable[Score]]
"""Scores one version of the gate's model (0: the base model); raises :class:`EvaluationError` when it cannot."""


@dataclass(frozen=True)
class LiveRewards:
    """Rewarded live rollouts of one version: how many, their mean and sample variance."""

    rollouts: int = 0
    mean: float | None = None
    variance: float = 0.0


@dataclass(frozen=True)
class CanaryVerdict:
    """What the canary's numbers say at one look: the verdict, and the difference and bounds it rests on."""

    verdict: Verdict
    enough: bool
    difference: float | None = None
    lower: float | None = None
    upper: float | None = None


def evaluation_verdict(candidate: Score, references: list[tuple[int, Score]], *, tolerance: float,
                       confidence: float) -> tuple[bool, str]:
    """Whether the candidate is shown no worse than every reference (version, score) by the tolerance, and why."""
    passes, compared = candidate.tasks >= 2, []
    for version, reference in references:
        difference, variance = paired_differences(candidate.rewards, reference.rewards)
        lower = paired_lower_bound(difference, variance, candidate.tasks, confidence) if candidate.tasks >= 2 \
            else -math.inf
        passes = passes and lower > -tolerance
        compared.append(f"v{version}'s {reference.mean:.3f} (paired difference {difference:+.3f}, lower bound "
                        f"{lower:+.3f})")
    return passes, (f"evaluation: {candidate.mean:.3f} on {candidate.tasks} tasks vs "
                    + " and best served ".join(compared))


def best_served(scores: dict[int, Score], served: set[int]) -> int | None:
    """The version that served all traffic with the highest evaluation score (the newest of equals)."""
    return max((v for v in served if v in scores), key=lambda v: (scores[v].mean, v), default=None)


def judge_canary(canary: LiveRewards, stable: LiveRewards, *, tolerance: float, confidence: float,
                 min_rollouts: int) -> CanaryVerdict:
    """The sequential test of :mod:`agentstream.deploy.sequential` on the live rewards so far (WAIT below the
    minimum)."""
    enough = canary.rollouts >= min_rollouts and stable.rollouts >= 2
    if not enough or canary.mean is None or stable.mean is None:
        return CanaryVerdict(Verdict.WAIT, False)
    difference, lower, upper = canary_bounds(
        float(canary.rollouts), canary.mean, canary.variance, float(stable.rollouts), stable.mean, stable.variance,
        tolerance=tolerance, confidence=confidence)
    return CanaryVerdict(canary_verdict(lower, upper, tolerance), True, difference, lower, upper)


LIVE_REWARDS_SQL = f"""
SELECT {ROLLOUT_POLICY_VERSION} AS version, count() AS rollouts, avg(final_reward) AS mean,
       ifNotFinite(varSamp(final_reward), 0) AS variance
FROM {{database}}.rollouts FINAL
WHERE model = {{model:String}} AND agent_name != {{gate_agent:String}} AND final_reward IS NOT NULL
  AND notEmpty(policy_versions) AND start_time >= fromUnixTimestamp64Micro({{since_us:Int64}}, 'UTC')
  AND {ROLLOUT_POLICY_VERSION} IN {{versions:Array(Int64)}}
GROUP BY version
"""


class Gate:
    """Decides what each new checkpoint of ``model`` becomes; ``run`` follows the checkpoints topic until stopped."""

    def __init__(self, config: Config, bootstrap_servers: str, model: str, *, evaluate: Evaluate, warehouse: Any,
                 deployments: DeploymentLog, server_url: str, poll_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.settings = config.deploy
        self.bootstrap_servers = bootstrap_servers
        self.model = model
        self.evaluate = evaluate
        self.warehouse = warehouse
        self.deployments = deployments
        self.server_url = server_url.rstrip("/").removesuffix("/v1")
        self.poll_s = poll_s
        self.clock = clock
        self.follower = DeploymentFollower(config, bootstrap_servers, on_decision=self._seen)
        self.checkpoint_follower = CheckpointFollower(config, bootstrap_servers, model)
        self.checkpoints = self.checkpoint_follower.checkpoints
        self.considered = 0  # the newest version decided on (by anyone) or under consideration
        self.seen_ids: set[str] = set()  # decisions about this model read back from the topic
        self.scores: dict[int, Score] = {}
        self.served: set[int] = {0}  # versions that served all traffic and no person rolled back

    @property
    def routing(self) -> Routing:
        return self.follower.routing(self.model) or Routing(self.model)

    async def run(self, stop: asyncio.Event) -> None:
        await announce(self.config, self.bootstrap_servers, self.model, "gate", gated=self.settings.gate, stop=stop)
        following = asyncio.create_task(self.follower.run(stop))
        await self.checkpoint_follower.start()
        try:
            await self.follower.until_ready(following)
            await self.checkpoint_follower.catch_up(timeout_ms=500)  # what exists before deciding anything
            await self._resume(stop)
            while not stop.is_set():
                if following.done():  # the deployments topic refused us: raise it
                    await following
                await self.checkpoint_follower.poll(timeout_ms=200)
                newest = max(self.checkpoints, default=0)
                if newest > self.considered:
                    await self._supersede(newest)
                    self.considered = newest
                    await self.consider(self.checkpoints[newest], stop)
        finally:
            await self.checkpoint_follower.stop()
            await following

    def _seen(self, decision: Decision) -> None:
        if decision.model == self.model:
            self.considered = max(self.considered, decision.version)
            if decision.action == Action.PROMOTED:
                self.served.add(decision.version)
            elif decision.action == Action.ROLLED_BACK and decision.decided_by != "gate":
                self.served.discard(decision.version)
            if len(self.seen_ids) > 10_000:
                self.seen_ids.clear()
            self.seen_ids.add(decision.decision_id)

    async def _record(self, decision: Decision) -> None:
        """Record a decision and wait until the routing read back from the topic includes it.

        What the gate checks next (has a person changed the candidate or canary?) is read from
        that routing, so it must not be older than the gate's own decision. A decision that cannot
        be recorded is retried with the same id, so a repeat is harmless.
        """
        while True:
            try:
                await self.deployments.record(decision)
                break
            except Exception as error:  # broker or ClickHouse away: the decision waits, it is not lost
                log.warning("could not record %s v%d %s (%s); retrying", decision.model, decision.version,
                            decision.action, error)
                await asyncio.sleep(self.poll_s)
        deadline = self.clock() + 30.0
        while decision.decision_id not in self.seen_ids and self.clock() < deadline:
            await asyncio.sleep(0.05)

    async def _resume(self, stop: asyncio.Event) -> None:
        """After a restart: take up the candidate or canary the routing names; versions decided on stay decided."""
        routing = self.routing
        if routing.canary_version is not None and routing.canary_version in self.checkpoints:
            log.info("resuming the canary of %s v%d", self.model, routing.canary_version)
            await self._watch_canary(self.checkpoints[routing.canary_version], routing.stable_version, stop)
        elif routing.candidate_version is not None and routing.candidate_version in self.checkpoints:
            await self.consider(self.checkpoints[routing.candidate_version], stop)

    async def _supersede(self, newest: int) -> None:
        for version in sorted(v for v in self.checkpoints if self.considered < v < newest):
            await self._record(decide(
                self.routing, version, Action.SUPERSEDED, "gate",
                f"v{newest} arrived before v{version} was considered; the gate considers the newest only"))

    async def consider(self, checkpoint: Checkpoint, stop: asyncio.Event) -> None:
        """Take one checkpoint through evaluation and canary to a decision."""
        version = checkpoint.version
        if checkpoint.format != "lora":
            await self._record(decide(
                self.routing, version, Action.REJECTED, "gate",
                "full-weight checkpoints cannot be evaluated next to the version serving (the server holds one "
                "copy of the weights): train with trainer.lora = true, or run without the gate"))
            return
        await self._record(decide(self.routing, version, Action.CANDIDATE, "gate",
                                             "new checkpoint: loading it for evaluation", candidate_version=version))
        if not await self._wait_until_loaded(version, stop):
            await self._record(decide(
                self.routing, version, Action.REJECTED, "gate",
                f"the model server did not list {adapter_name(self.model, version)} within "
                f"{self.settings.load_timeout_s:.0f} s", candidate_version=None))
            return
        stable_version = self.routing.stable_version
        try:
            candidate, stable = await self._score(version), await self._score(stable_version)
            references = [(stable_version, stable)]
            best = best_served(self.scores, self.served)
            if best is not None and best != stable_version and self.scores[best].mean > stable.mean:
                references.append((best, await self._reference(best)))
        except EvaluationError as error:
            if self.routing.candidate_version == version:
                await self._record(decide(
                    self.routing, version, Action.REJECTED, "gate",
                    f"evaluation failed: {error}; the candidate was not judged", candidate_version=None))
            return
        scores = dict(candidate_score=candidate.mean, stable_score=stable.mean, eval_tasks=candidate.tasks)
        if self.routing.candidate_version != version:
            return  # a person decided meanwhile
        passes, summary = evaluation_verdict(candidate, references, tolerance=self.settings.tolerance,
                                             confidence=self.settings.confidence)
        if not passes:
            await self._record(decide(
                self.routing, version, Action.REJECTED, "gate",
                f"{summary}: not shown within the tolerance {self.settings.tolerance} at "
                f"{self.settings.confidence:.0%} confidence", candidate_version=None, **scores))
            return
        await self._record(decide(
            self.routing, version, Action.CANARY, "gate",
            f"{summary}; canary on {self.settings.canary_share:.0%} of live rollouts",
            candidate_version=None, canary_version=version, canary_share=self.settings.canary_share, **scores))
        await self._watch_canary(checkpoint, stable_version, stop)

    async def _score(self, version: int) -> Score:
        """Evaluate ``version`` afresh (a score kept from before would hide a server that changed since)."""
        score = await self.evaluate(version)
        self.scores[version] = score
        log.info("%s v%d scores %.3f on %d evaluation tasks", self.model, version, score.mean, score.tasks)
        return score

    async def _reference(self, version: int) -> Score:
        """A version that served before, scored afresh where a server still holds it, else by its last score.

        Hot swap unloads what no routing names, so a version that served two promotions ago is
        often gone; its last score still keeps candidates from sliding below it.
        """
        try:
            return await self._score(version)
        except EvaluationError as error:
            log.info("%s v%d is compared by its last score (%.3f): %s", self.model, version,
                     self.scores[version].mean, error)
            return self.scores[version]

    async def _wait_until_loaded(self, version: int, stop: asyncio.Event) -> bool:
        name = adapter_name(self.model, version)
        deadline = self.clock() + self.settings.load_timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            while not stop.is_set() and self.clock() < deadline:
                try:
                    async with session.get(f"{self.server_url}/v1/models") as response:
                        listed = await response.json(content_type=None)
                    if any(entry.get("id") == name for entry in listed.get("data") or ()):
                        return True
                except (aiohttp.ClientError, ValueError, AttributeError, TimeoutError) as error:
                    log.warning("model server %s: %s", self.server_url, error)
                await asyncio.sleep(0.2)
        return False

    async def _watch_canary(self, checkpoint: Checkpoint, stable_version: int, stop: asyncio.Event) -> None:
        version = checkpoint.version
        settings = self.settings
        started, since_us = self.clock(), time.time_ns() // 1000
        while not stop.is_set():
            await asyncio.sleep(self.poll_s)
            if self.routing.canary_version != version:
                return  # a person decided meanwhile
            live = await self._live_rewards(since_us, [version, stable_version])
            canary, stable = live.get(version, LiveRewards()), live.get(stable_version, LiveRewards())
            verdict = judge_canary(canary, stable, tolerance=settings.tolerance, confidence=settings.confidence,
                                   min_rollouts=settings.canary_min_rollouts)
            elapsed = self.clock() - started
            numbers = dict(canary_reward=canary.mean, canary_rollouts=canary.rollouts, stable_reward=stable.mean,
                           stable_rollouts=stable.rollouts)
            summary = (f"live reward {_mean(canary)} over {canary.rollouts} canary rollouts vs v{stable_version}'s "
                       f"{_mean(stable)} over {stable.rollouts}")
            bounds = ("" if not verdict.enough else f"difference {verdict.difference:+.3f}, always-valid "
                      f"{settings.confidence:.0%} bounds [{verdict.lower:+.3f}, {verdict.upper:+.3f}]")
            if verdict.verdict == Verdict.ROLL_BACK:
                await self._record(decide(
                    self.routing, version, Action.ROLLED_BACK, "gate",
                    f"canary: {summary}; worse by more than {settings.tolerance} ({bounds})",
                    canary_version=None, canary_share=0.0, **numbers))
                return
            if verdict.verdict == Verdict.PROMOTE and elapsed >= settings.canary_min_s:
                await self._record(decide(
                    self.routing, version, Action.PROMOTED, "gate",
                    f"canary: {summary} after {elapsed:.0f} s; no worse than {settings.tolerance} ({bounds})",
                    stable_version=version, stable_uri=checkpoint.uri, format=checkpoint.format,
                    canary_version=None, canary_share=0.0, **numbers))
                return
            if elapsed >= settings.canary_max_s:
                why = (f"fewer than {settings.canary_min_rollouts} rewarded canary rollouts" if not verdict.enough
                       else f"still undecided ({bounds})")
                await self._record(decide(
                    self.routing, version, Action.ROLLED_BACK, "gate",
                    f"canary: {summary} after {elapsed:.0f} s: {why}; not promoted without evidence (more traffic, "
                    "a larger canary_share or canary_max_s, or a wider tolerance decide sooner)",
                    canary_version=None, canary_share=0.0, **numbers))
                return

    async def _live_rewards(self, since_us: int, versions: list[int]) -> dict[int, LiveRewards]:
        sql = LIVE_REWARDS_SQL.replace("{database}", self.config.clickhouse.database)
        parameters = {"model": self.model, "gate_agent": GATE_AGENT, "since_us": since_us, "versions": versions}
        try:
            result = await asyncio.to_thread(self.warehouse.query, sql, parameters=parameters)
        except Exception as error:  # ClickHouse down: the canary waits, it does not decide on no data
            log.warning("live rewards unavailable (%s); the canary keeps running", error)
            return {}
        return {int(v): LiveRewards(int(n), float(mean), float(var)) for v, n, mean, var in result.result_rows}


def _mean(rewards: LiveRewards) -> str:
    return "n/a" if rewards.mean is None else f"{rewards.mean:.3f}"

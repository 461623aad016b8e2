"""The gate's verdicts: canaries judged on live rewards, candidates evaluated against stable and best served."""

from __future__ import annotations

import asyncio

import pytest

from agentstream.deploy.gate import (
    EvaluationError,
    Gate,
    LiveRewards,
    Score,
    best_served,
    evaluation_verdict,
    judge_canary,
)
from agentstream.deploy.sequential import Verdict
from agentstream.infra.config import load_config


def bernoulli(successes: int, rollouts: int) -> LiveRewards:
    """Live 0/1 rewards: their count, mean and sample variance."""
    mean = successes / rollouts
    return LiveRewards(rollouts, mean, mean * (1 - mean) * rollouts / (rollouts - 1))


def test_a_canary_clearly_worse_than_stable_is_rolled_back():
    verdict = judge_canary(LiveRewards(20, 0.0, 0.0), bernoulli(63, 180), tolerance=0.05, confidence=0.95,
                           min_rollouts=20)
    assert verdict.verdict == Verdict.ROLL_BACK and verdict.upper < -0.05


def test_a_canary_is_not_promoted_on_a_lack_of_evidence():
    """The issue's case: 12 of 20 against 80% over 180 was promoted; it is 20 points worse on its face."""
    verdict = judge_canary(bernoulli(12, 20), bernoulli(144, 180), tolerance=0.05, confidence=0.95, min_rollouts=20)
    assert verdict.enough and verdict.verdict == Verdict.WAIT
    assert verdict.difference == pytest.approx(-0.2) and verdict.lower < -0.05 < verdict.upper
    as_good = judge_canary(bernoulli(16, 20), bernoulli(144, 180), tolerance=0.05, confidence=0.95, min_rollouts=20)
    assert as_good.verdict == Verdict.WAIT  # as good on 20 rollouts is not yet shown within 0.05


def test_a_canary_as_good_as_stable_is_promoted_once_the_data_show_it():
    promoted = judge_canary(bernoulli(800, 1000), bernoulli(7200, 9000), tolerance=0.05, confidence=0.95,
                            min_rollouts=20)
    assert promoted.verdict == Verdict.PROMOTE and -0.05 < promoted.lower < 0 < promoted.upper
    waiting = judge_canary(bernoulli(240, 300), bernoulli(2160, 2700), tolerance=0.05, confidence=0.95,
                           min_rollouts=20)
    assert waiting.verdict == Verdict.WAIT  # the same rate on 300: the always-valid bound is still wider than 0.05


def test_no_verdict_without_enough_rewarded_rollouts():
    verdict = judge_canary(LiveRewards(19, 0.0, 0.0), LiveRewards(100, 1.0, 0.0), tolerance=0.05, confidence=0.95,
                           min_rollouts=20)
    assert not verdict.enough and verdict.verdict == Verdict.WAIT
    assert not judge_canary(LiveRewards(30, 0.0, 0.0), LiveRewards(1, 1.0, 0.0), tolerance=0.05, confidence=0.95,
                            min_rollouts=20).enough


def outcomes(losses: int, wins: int, tasks: int = 32) -> tuple[Score, Score]:
    """A candidate and a stable version on ``tasks`` tasks: the candidate loses ``losses`` and wins ``wins``."""
    stable = [1.0] * losses + [0.0] * wins + [1.0 if task % 4 else 0.0 for task in range(tasks - losses - wins)]
    candidate = [0.0] * losses + [1.0] * wins + stable[losses + wins:]
    return Score(tuple(candidate)), Score(tuple(stable))


def test_the_evaluation_passes_only_what_it_shows_within_the_tolerance():
    candidate, stable = outcomes(losses=7, wins=2)  # 16 points worse: the case, which passed
    passes, reason = evaluation_verdict(candidate, [(3, stable)], tolerance=0.05, confidence=0.95)
    assert not passes and "paired difference -0.156" in reason
    assert evaluation_verdict(*outcomes(0, 0)[:1], [(3, outcomes(0, 0)[1])], tolerance=0.05, confidence=0.95)[0]
    better, stable = outcomes(losses=0, wins=8)
    assert evaluation_verdict(better, [(3, stable)], tolerance=0.05, confidence=0.95)[0]
    even, stable = outcomes(losses=1, wins=1)  # as good on its face, but 32 tasks cannot show it within 0.05
    assert not evaluation_verdict(even, [(3, stable)], tolerance=0.05, confidence=0.95)[0]
    assert evaluation_verdict(even, [(3, stable)], tolerance=0.1, confidence=0.95)[0]
    assert not evaluation_verdict(Score((1.0,)), [(3, Score((1.0,)))], tolerance=0.05, confidence=0.95)[0]


def test_candidates_each_a_little_worse_cannot_slide_far_below_the_best_served_version():
    def score(version: int) -> Score:  # every task 0.03 lower than the version before: each step within 0.05
        return Score(tuple(0.9 - 0.01 * (task % 5) - 0.03 * version for task in range(32)))

    scores = {version: score(version) for version in range(7)}

    def promote_in_turn(against_best: bool) -> tuple[int, list[str]]:
        served, stable, reasons = {0}, 0, []
        for version in range(1, 7):
            best = best_served(scores, served)
            references = [(stable, scores[stable])]
            if against_best and best is not None and best != stable:
                references.append((best, scores[best]))
            passes, reason = evaluation_verdict(scores[version], references, tolerance=0.05, confidence=0.95)
            reasons.append(reason)
            if passes:
                served.add(version)
                stable = version
        return stable, reasons

    stable_only, _ = promote_in_turn(against_best=False)
    assert stable_only == 6  # step by step each was within the tolerance: 0.18 lost in all
    with_best, reasons = promote_in_turn(against_best=True)
    assert with_best == 1 and "and best served v0's" in reasons[-1]


def test_best_served_is_the_highest_scoring_served_version_and_ignores_unscored_ones():
    scores = {0: Score((0.0, 1.0)), 3: Score((1.0, 1.0)), 5: Score((1.0, 1.0)), 7: Score((0.0, 0.0))}
    assert best_served(scores, {0, 3, 5, 7, 9}) == 5  # the newest of equals; v9 was never scored here
    assert best_served(scores, {0, 7}) == 0
    assert best_served(scores, set()) is None


def test_a_served_version_no_server_holds_any_more_is_compared_by_its_last_score():
    async def evaluate(version: int) -> Score:
        if version == 1:  # hot swap unloaded it when v2 was promoted
            raise EvaluationError("version 1 of model `m` is not loaded on the model server")
        return Score((1.0, 0.0, 1.0, 1.0))

    gate = Gate(load_config(environ={}), "127.0.0.1:9", "m", evaluate=evaluate, warehouse=None, deployments=None,
                server_url="http://127.0.0.1:9")
    gate.scores[1] = Score((1.0, 1.0, 1.0, 0.0))
    assert asyncio.run(gate._reference(1)) == Score((1.0, 1.0, 1.0, 0.0))
    assert asyncio.run(gate._reference(2)) == Score((1.0, 0.0, 1.0, 1.0)) == gate.scores[2]  # afresh where held

"""Rebase: after a streak of refused candidates the trainer goes back to the serving version."""

from __future__ import annotations

from agentstream.deploy.deployments import Action, Routing, decide
from agentstream.deploy.rebase import RejectionStreak


def test_the_trainer_goes_back_to_the_serving_version_after_a_streak_of_refused_candidates():
    streak = RejectionStreak("m", limit=3)
    served = decide(Routing("m"), 4, Action.PROMOTED, "gate", "canary passed", stable_version=4,
                    stable_uri="file:///ckpt/m/v00000004")
    history = [served, decide(served.routing, 5, Action.REJECTED, "gate", "worse"),
               decide(served.routing, 6, Action.REJECTED, "gate", "worse"),
               decide(served.routing, 7, Action.ROLLED_BACK, "gate", "canary worse")]
    for decision in history:  # read at start-up: made before the checkpoint the trainer resumed from
        streak.seen(decision)
    assert streak.due() is None and streak.routing == served.routing

    streak.live = True
    routing = served.routing
    for version, action in [(8, Action.REJECTED), (9, Action.SUPERSEDED), (10, Action.ROLLED_BACK),
                            (11, Action.CANARY), (12, Action.REJECTED), (13, Action.CANDIDATE)]:
        streak.seen(decide(routing, version, action, "gate", "..."))
        streak.seen(decide(routing, version, Action.REJECTED, "gate", "...", model="other"))
        assert streak.due() is None  # a canary ended the first streak; superseded and other models do not count
    streak.seen(decide(routing, 14, Action.REJECTED, "gate", "worse"))
    streak.seen(decide(routing, 15, Action.ROLLED_BACK, "gate", "canary worse"))
    assert streak.due() == served.routing
    assert streak.clear() == [12, 14, 15] and streak.due() is None


def test_no_rebase_while_the_base_model_serves_or_when_turned_off():
    base = Routing("m")
    for limit, routing in [(2, base), (0, Routing("m", stable_version=3, stable_uri="file:///v3"))]:
        streak = RejectionStreak("m", limit=limit, live=True)
        for version in (1, 2, 3):
            streak.seen(decide(routing, version, Action.REJECTED, "gate", "worse"))
        assert streak.due() is None


def test_a_trainer_too_far_ahead_of_the_serving_version_goes_back_after_one_refusal_when_none_is_pending():
    """Every transition served is staler than the lag bound and no candidate is pending: it would wait forever."""
    served = decide(Routing("m"), 2, Action.PROMOTED, "gate", "canary passed", stable_version=2,
                    stable_uri="s3://b/m/v00000002")
    streak = RejectionStreak("m", limit=3, live=True)
    streak.seen(served)
    assert streak.due(version=30, max_lag=20) is None  # nothing refused yet: the gate has its say first
    for version, action, candidate in [(14, Action.CANDIDATE, 14), (14, Action.REJECTED, None),
                                       (23, Action.CANDIDATE, 23)]:
        streak.seen(decide(streak.routing, version, action, "gate", "...", candidate_version=candidate))
    assert streak.due(version=23, max_lag=20) is None  # v23 is still pending
    refused = decide(streak.routing, 23, Action.REJECTED, "gate", "worse", candidate_version=None)
    streak.seen(refused)
    assert streak.due(version=22, max_lag=20) is None  # v2's transitions still train v22
    assert streak.due(version=23, max_lag=20) == refused.routing == served.routing
    assert streak.due() is None  # without the trainer's version, only the streak of 3 counts

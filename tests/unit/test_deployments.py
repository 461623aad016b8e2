"""Deployment routing, version pins and the canary's statistics: the pure parts, without services."""

from __future__ import annotations

import pytest

from infra.deployments import Action, Decision, Routing, adapter_name, decide, share_of, split_adapter_name
from pipeline.routing import RouteError, resolve_route
from schemas import DEPLOYMENT, AvroCodec
from trainer.gate import LiveRewards, judge_canary
from trainer.rebase import RejectionStreak


class Table:
    def __init__(self, *routes: Routing) -> None:
        self.routes = {r.model: r for r in routes}

    def routing(self, model: str) -> Routing | None:
        return self.routes.get(model)


def test_adapter_names_round_trip_and_plain_names_have_no_version():
    assert split_adapter_name(adapter_name("org/model@x", 17)) == ("org/model@x", 17)
    assert split_adapter_name("smollm2") == ("smollm2", None)
    assert split_adapter_name("m@vx") == ("m@vx", None)


def test_the_canary_share_is_taken_by_rollout_and_is_stable():
    routing = Routing("m", stable_version=3, canary_version=5, canary_share=0.1)
    chosen = [routing.choose(f"rollout-{i}") for i in range(20_000)]
    canary = sum(reason == "canary" for _, reason in chosen)
    assert 0.09 < canary / len(chosen) < 0.11
    assert all(version == (5 if reason == "canary" else 3) for version, reason in chosen)
    assert [routing.choose(f"rollout-{i}") for i in range(200)] == chosen[:200]
    assert 0.0 <= share_of("anything") < 1.0


def test_full_weights_serve_only_the_stable_version():
    routing = Routing("m", stable_version=4, format="full", canary_version=5, canary_share=1.0)
    assert routing.loaded_versions() == [4]
    assert routing.choose("r") == (4, "stable")


def test_requests_for_a_trained_model_go_to_its_deployed_adapter_and_pins_are_checked():
    table = Table(Routing("m", stable_version=3, candidate_version=4))
    route = resolve_route(table, "m", None, "r1")
    assert (route.model, route.upstream_model, route.version, route.reason) == ("m", "m@v3", 3, "stable")
    assert resolve_route(table, "m@v4", None, "r1").upstream_model == "m@v4"  # the candidate may be pinned
    assert resolve_route(table, "m", "v0", "r1").upstream_model == "m"  # v0 is the base model's own name
    assert resolve_route(table, "m", "4", "r1").reason == "pinned"
    with pytest.raises(RouteError, match="version 2 of model `m` is not loaded") as refused:
        resolve_route(table, "m@v2", None, "r1")
    assert refused.value.status == 404
    with pytest.raises(RouteError, match="must be a version number") as malformed:
        resolve_route(table, "m", "latest", "r1")
    assert malformed.value.status == 400
    with pytest.raises(RouteError, match="pins 'm@v3'"):
        resolve_route(table, "m@v3", "4", "r1")


def test_models_without_deployments_pass_through_unchanged():
    route = resolve_route(Table(), "other", None, "r")
    assert (route.upstream_model, route.version, route.reason) == ("other", None, "unrouted")
    assert resolve_route(None, "other@v2", None, "r").version == 2
    assert resolve_route(Table(), None, None, "r").reason == "unrouted"


def test_a_decision_is_an_avro_event_and_a_row():
    before = Routing("m", stable_version=2, stable_uri="file:///c/v2")
    decision = decide(before, 5, Action.CANARY, "gate", "passed", canary_version=5, canary_share=0.1,
                      candidate_score=0.8, stable_score=0.7, eval_tasks=32)
    assert decision.routing == Routing("m", 2, "file:///c/v2", "lora", 5, 0.1, None)
    codec = AvroCodec()
    assert Decision.from_record(codec.decode(codec.encode(DEPLOYMENT, decision.record()), DEPLOYMENT)[1]) == decision
    row = decision.row()
    assert row[:4] == [decision.decision_id, "m", 5, "CANARY"] and row[-1].timestamp() == decision.at_us / 1e6


def test_a_canary_clearly_worse_than_stable_is_rolled_back():
    broken = LiveRewards(20, 0.0, 0.0)
    stable = LiveRewards(180, 0.35, 0.35 * 0.65)
    verdict = judge_canary(broken, stable, tolerance=0.05, confidence=0.95, min_rollouts=20)
    assert verdict.enough and verdict.worse and verdict.upper_bound < -0.05


def test_a_canary_as_good_as_stable_passes_and_noise_alone_does_not_fail_it():
    same = judge_canary(LiveRewards(20, 0.30, 0.21), LiveRewards(180, 0.35, 0.2275), tolerance=0.05,
                        confidence=0.95, min_rollouts=20)
    assert same.enough and not same.worse and same.difference == pytest.approx(-0.05)


def test_no_verdict_without_enough_rewarded_rollouts():
    verdict = judge_canary(LiveRewards(19, 0.0, 0.0), LiveRewards(100, 1.0, 0.0), tolerance=0.05, confidence=0.95,
                           min_rollouts=20)
    assert not verdict.enough and not verdict.worse
    assert not judge_canary(LiveRewards(30, 0.0, 0.0), LiveRewards(1, 1.0, 0.0), tolerance=0.05, confidence=0.95,
                            min_rollouts=20).enough


def test_the_evaluation_rejects_what_is_worse_beyond_its_noise_not_the_noise_itself():
    from trainer.gate import Score, evaluation_bound

    stable = Score((1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0) * 4)  # 50% on 32 tasks
    broken = Score((0.0,) * 32)
    difference, upper = evaluation_bound(broken, stable, 0.95)
    assert difference == -0.5 and upper < -0.05
    noisy = Score(tuple(1.0 - r if i in (0, 2) else r for i, r in enumerate(stable.rewards)))  # two tasks lost
    difference, upper = evaluation_bound(noisy, stable, 0.95)
    assert difference == pytest.approx(-2 / 32) and upper > -0.05


def test_candidates_each_a_little_worse_cannot_slide_far_below_the_best_served_version():
    from trainer.gate import Score, best_served, evaluation_verdict

    def score(correct: int) -> Score:  # the first `correct` of 32 tasks right, so a worse version loses tasks
        return Score(tuple(1.0 if task < correct else 0.0 for task in range(32)))

    scores = {version: score(28 - 2 * version) for version in range(7)}  # each two tasks (0.0625) worse

    def promote_in_turn(against_best: bool) -> tuple[int, list[str]]:
        served, stable, reasons = {0}, 0, []
        for version in range(1, 7):
            best = best_served(scores, served)
            references = [(stable, scores[stable])]
            if against_best and best is not None and best != stable:
                references.append((best, scores[best]))
            worse, reason = evaluation_verdict(scores[version], references, tolerance=0.05, confidence=0.95)
            reasons.append(reason)
            if not worse:
                served.add(version)
                stable = version
        return stable, reasons

    stable_only, _ = promote_in_turn(against_best=False)
    assert stable_only == 6 and scores[6].mean == 0.5  # step by step each looked like noise: 0.875 slid to 0.5
    with_best, reasons = promote_in_turn(against_best=True)
    assert scores[with_best].mean >= 0.75  # the slide stopped within about two noise-sized steps of the best
    assert "and best served v0's 0.875" in reasons[-1]


def test_best_served_is_the_highest_scoring_served_version_and_ignores_unscored_ones():
    from trainer.gate import Score, best_served

    scores = {0: Score((0.0, 1.0)), 3: Score((1.0, 1.0)), 5: Score((1.0, 1.0)), 7: Score((0.0, 0.0))}
    assert best_served(scores, {0, 3, 5, 7, 9}) == 5  # the newest of equals; v9 was never scored here
    assert best_served(scores, {0, 7}) == 0
    assert best_served(scores, set()) is None


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

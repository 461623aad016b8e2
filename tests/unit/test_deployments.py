"""Deployment routing, version pins, the gate's statistics and its announcements: the pure parts, without services."""

from __future__ import annotations

import pytest

from deploy.deployments import (
    Action,
    Announcement,
    Decision,
    Routing,
    adapter_name,
    decide,
    disagreement,
    share_of,
    split_adapter_name,
)
from deploy.gate import LiveRewards, Score, best_served, evaluation_verdict, judge_canary
from deploy.rebase import RejectionStreak
from deploy.routing import RouteError, resolve_route
from deploy.sequential import Verdict, mixture_half_width, t_quantile
from schemas import ANNOUNCEMENT, DEPLOYMENT, AvroCodec


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


# The bytes main (4837efc) wrote for these two events, before Announcement had record()/from_record() and
# Action had OTHER: the typed records must write the same bytes, and read the events already on the topic.
DECISION = Decision(version=5, action=Action.CANARY, decided_by="gate", reason="passed: 0.80 vs 0.70 on 32 tasks",
                    routing=Routing("m", stable_version=2, stable_uri="file:///c/v2", format="lora", canary_version=5,
                                    canary_share=0.1, candidate_version=None),
                    candidate_score=0.8, stable_score=0.7, eval_tasks=32, canary_reward=None, canary_rollouts=0,
                    stable_reward=0.5, stable_rollouts=12, at_us=1_764_000_000_123_456, decision_id="d" * 32)
DECISION_BYTES = bytes.fromhex(
    "00759d5ca2406464646464646464646464646464646464646464646464646464646464646464026d0a040867617465407061737365643a"
    "20302e383020767320302e3730206f6e203332207461736b73086c6f7261041866696c653a2f2f2f632f7632020a9a9999999999b93f00"
    "029a9999999999e93f02666666666666e63f40000002000000000000e03f188089a196a896a206")
ANNOUNCEMENT_RECORD = Announcement("m", "gate", True, "host:12:abcdef", 1_764_000_000_123_456, 20.0)
ANNOUNCEMENT_BYTES = bytes.fromhex(
    "0067f31d9c026d0867617465011c686f73743a31323a6162636465668089a196a896a2060000000000003440")


def test_deployment_events_keep_their_wire_bytes_and_old_events_still_read():
    codec = AvroCodec()
    assert codec.encode(DEPLOYMENT, DECISION.record()) == DECISION_BYTES
    assert Decision.from_record(codec.decode(DECISION_BYTES, DEPLOYMENT)[1]) == DECISION
    assert codec.encode(ANNOUNCEMENT, ANNOUNCEMENT_RECORD.record()) == ANNOUNCEMENT_BYTES
    assert Announcement.from_record(codec.decode(ANNOUNCEMENT_BYTES, ANNOUNCEMENT)[1]) == ANNOUNCEMENT_RECORD
    newer = {**DECISION.record(), "action": "OTHER"}  # what the reader schema makes of an action it does not know
    assert Decision.from_record(newer).action is Action.OTHER


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


def test_the_bound_is_valid_at_every_look_where_a_fixed_test_is_not():
    """Looked at after every canary rollout up to 2,000, at a true difference of exactly -tolerance."""
    from bench.gate import simulate_canaries

    sequential = simulate_canaries(difference=-0.05, canaries=400, horizon=2000, seed=1)
    assert sequential.promoted <= 0.05 * 400 + 8  # at most alpha, with room for the sampling noise of 400 runs
    naive = simulate_canaries(difference=-0.05, canaries=400, horizon=2000, seed=1, rule="fixed")
    assert naive.promoted > 0.15 * 400  # the fixed one-sided test re-run at each look promotes far more often


def test_the_mixture_bound_shrinks_with_the_variance_and_grows_with_the_confidence():
    widths = [mixture_half_width(v, 0.05, 0.95) for v in (1e-2, 1e-3, 1e-4, 1e-5)]
    assert widths == sorted(widths, reverse=True) and mixture_half_width(0.0, 0.05, 0.95) == 0.0
    assert mixture_half_width(1e-3, 0.05, 0.99) > mixture_half_width(1e-3, 0.05, 0.95)
    assert t_quantile(0.95, 31.0) == pytest.approx(1.6955, abs=1e-3)
    assert t_quantile(0.95, 5.0) == pytest.approx(2.0150, abs=2e-3)
    with pytest.raises(ValueError, match="tolerance > 0"):
        mixture_half_width(1e-3, 0.0, 0.95)


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


def test_a_gate_and_a_hot_swap_that_promotes_by_itself_disagree():
    def said(role: str, gated: bool, instance: str, at_us: int = 1_000_000_000, live_s: float = 20.0):
        return Announcement("m", role, gated, instance, at_us, live_s)

    now = 1_000_000_000 + 5_000_000
    gate, promoting, gated_swap = said("gate", True, "g"), said("hotswap", False, "h"), said("hotswap", True, "h2")
    assert "deploy.gate = false" in disagreement(promoting, [gate], now)
    assert "restart hot swap with deploy.gate = true" in disagreement(gate, [promoting], now)
    assert disagreement(gated_swap, [gate], now) is None
    assert disagreement(promoting, [said("hotswap", False, "h3")], now) is None  # many servers, many hot swaps
    assert disagreement(promoting, [said("gate", True, "g", live_s=0.0)], now) is None  # withdrawn
    assert disagreement(promoting, [said("gate", True, "g", at_us=now - 30_000_000)], now) is None  # lapsed
    other_model = Announcement("other", "gate", True, "g", 1_000_000_000, 20.0)
    assert disagreement(promoting, [other_model], now) is None


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

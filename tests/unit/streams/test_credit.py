"""Credit assignment on hand-built trajectories, with hand-checked numbers, and the rules that pick a strategy."""

from __future__ import annotations

import pytest

from agentstream.infra.config import CreditRule
from agentstream.streams.credit import DiscountedReturns, FinalReward, GroupNormalized, matching_rule
from agentstream.streams.trajectory import SpanNode, Trajectory, assemble
from tests.support.streams_fakes import node


def trajectory():
    """root[0..100]: llm1@10, reward 1.0 @20, llm2@30, llm3@50, reward 2.0 @60, final reward 4.0 @90."""
    spans = [
        node("root", "AGENT", 0, 100),
        node("llm1", "LLM", 10, 15, "root"),
        node("r1", "REWARD", 20, parent="root", reward=1.0),
        node("llm2", "LLM", 30, 35, "root"),
        node("llm3", "LLM", 50, 55, "root"),
        node("r2", "REWARD", 60, parent="root", reward=2.0),
        node("r3", "REWARD", 90, parent="root", reward=4.0),
    ]
    return assemble("ro", spans, "SUCCEEDED", "a1")


def test_final_strategy_broadcasts_the_last_reward():
    credits = FinalReward().assign(trajectory())
    assert [(c.call.span_id, c.step_index, c.reward, c.advantage) for c in credits] == [
        ("llm1", 0, 4.0, 4.0), ("llm2", 1, 4.0, 4.0), ("llm3", 2, 4.0, 4.0)]


def test_discounted_strategy_honours_intermediate_rewards():
    credits = DiscountedReturns(gamma=0.5).assign(trajectory())
    # step rewards: llm1 gets r1 = 1; llm2 gets 0; llm3 gets r2 + r3 = 6
    # returns: G3 = 6, G2 = 0 + 0.5 * 6 = 3, G1 = 1 + 0.5 * 3 = 2.5
    assert [(c.reward, c.return_value, c.advantage) for c in credits] == [(1.0, 2.5, 2.5), (0.0, 3.0, 3.0),
                                                                          (6.0, 6.0, 6.0)]
    undiscounted = DiscountedReturns(gamma=1.0).assign(trajectory())
    assert [c.return_value for c in undiscounted] == [7.0, 6.0, 6.0]


def test_reward_before_the_first_call_goes_to_the_first_call():
    spans = [node("r0", "REWARD", 1, reward=0.5), node("llm", "LLM", 5, 6), node("llm2", "LLM", 8, 9)]
    credits = DiscountedReturns(gamma=1.0).assign(assemble("ro", spans, "SUCCEEDED", "a1"))
    assert [c.reward for c in credits] == [0.5, 0.0]


def test_grpo_normalises_within_the_group():
    members = []
    for index, reward in enumerate([1.0, 0.0, 0.0, 1.0]):
        spans = [node(f"llm{index}", "LLM", 1, 2), node(f"r{index}", "REWARD", 3, reward=reward)]
        members.append(assemble(f"ro{index}", spans, "SUCCEEDED", "a1"))
    credits = GroupNormalized(epsilon=0.0).assign_group(members)
    # mean 0.5, population std 0.5: advantages +1 / -1
    assert [credits[f"ro{i}"][0].advantage for i in range(4)] == [1.0, -1.0, -1.0, 1.0]
    same = [assemble(f"s{i}", [node(f"l{i}", "LLM", 1, 2), node(f"q{i}", "REWARD", 3, reward=1.0)], "SUCCEEDED", "a1")
            for i in range(3)]
    assert not GroupNormalized.informative([t.final_reward for t in same])
    assert all(c[0].advantage == 0.0 for c in GroupNormalized().assign_group(same).values())


def test_calls_without_token_ids_are_not_trainable():
    spans = [node("llm", "LLM", 1, 2, tokens=False), node("llm2", "LLM", 3, 4), node("r", "REWARD", 5, reward=1.0)]
    trajectory_ = assemble("ro", spans, "SUCCEEDED", "a1")
    assert [c.span_id for c in trajectory_.llm_calls] == ["llm", "llm2"]
    assert [c.call.span_id for c in FinalReward().assign(trajectory_)] == ["llm2"]


def test_rules_select_agents_and_models_first_match_wins():
    rules = (CreditRule(agent="internal-*", train=False), CreditRule(agent="*", model="gpt-*", strategy="discounted"),
             CreditRule())
    assert not matching_rule(rules, "internal-tool", "x").train
    assert matching_rule(rules, "math", "gpt-4o").strategy == "discounted"
    assert matching_rule(rules, "math", "smollm").strategy == "final"
    assert matching_rule((CreditRule(agent="only"),), "other", "m") is None


@pytest.mark.parametrize("gamma", [0.0, 1.0])
def test_discount_edges(gamma):
    credits = DiscountedReturns(gamma).assign(trajectory())
    assert credits[0].return_value == (1.0 if gamma == 0.0 else 7.0)


def test_the_running_baseline_centres_online_rewards_per_agent():
    from agentstream.streams.credit import RunningBaseline, strategy_for

    rule = CreditRule(strategy="baseline")
    assert strategy_for(rule) is strategy_for(rule)  # one stateful object per rule
    baseline = RunningBaseline(decay=0.5)

    def advantage(agent: str, reward: float) -> float:
        call = SpanNode("c", "", "LLM", "chat", 0, 1, "a", has_token_ids=True)
        rewarded = SpanNode("r", "", "REWARD", "reward", 2, 2, "a", reward=reward)
        trajectory = Trajectory("r", "a", "SUCCEEDED", agent, "", "", [call, rewarded], [call], [call], [rewarded])
        (credit,) = baseline.assign(trajectory)
        assert credit.reward == reward
        return credit.advantage

    assert advantage("x", 1.0) == 0.0  # the first reward sets the mean
    assert advantage("x", 0.0) == -1.0
    assert advantage("x", 1.0) == 0.5  # mean 0.5 after (1, 0)
    assert advantage("y", 0.0) == 0.0  # another agent has its own mean

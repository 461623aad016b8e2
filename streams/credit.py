"""Credit assignment: from a trajectory's rewards to a reward, return and advantage per LLM call.

A strategy is a small object with ``assign(trajectory) -> list[Credit]`` (one per trainable LLM
call, in call order); group strategies also implement ``assign_group(trajectories)``. Register
a custom one in :data:`STRATEGIES` to select it by name from ``[[credit]]`` rules.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import NamedTuple, Protocol

from infra.config import CreditRule
from streams.trajectory import SpanNode, Trajectory


class Credit(NamedTuple):
    """What one LLM call is credited with (a tuple: thousands are made per second)."""

    call: SpanNode
    step_index: int
    reward: float
    return_value: float
    advantage: float


class CreditStrategy(Protocol):
    grouped: bool

    def assign(self, trajectory: Trajectory) -> list[Credit]: ...


class FinalReward:
    """Every call gets the rollout's final reward (the last one emitted), as Agent Lightning does."""

    grouped = False

    def assign(self, trajectory: Trajectory) -> list[Credit]:
        final = trajectory.final_reward or 0.0
        return [Credit(call, index, final, final, final) for index, call in enumerate(trajectory.trainable_calls)]


class DiscountedReturns:
    """Intermediate rewards attach to the most recent preceding LLM call; returns are discounted back by gamma.

    A reward emitted before the first call is credited to the first call. The advantage is the
    return (no baseline): a trainer normalises per batch if it wants to.
    """

    grouped = False

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    def assign(self, trajectory: Trajectory) -> list[Credit]:
        calls = trajectory.trainable_calls
        if not calls:
            return []
        step_rewards = [0.0] * len(calls)
        for reward in trajectory.rewards:
            index = 0
            for position, call in enumerate(calls):
                if call.start_us <= reward.end_us:
                    index = position
            step_rewards[index] += reward.reward or 0.0
        returns = [0.0] * len(calls)
        running = 0.0
        for index in range(len(calls) - 1, -1, -1):
            running = step_rewards[index] + self.gamma * running
            returns[index] = running
        return [Credit(call, i, step_rewards[i], returns[i], returns[i]) for i, call in enumerate(calls)]


class RunningBaseline:
    """Online traffic, which has no groups: the advantage is the final reward minus a running mean of past ones.

    The mean is an exponential moving average (``decay`` per rollout, about the last 50 rollouts
    at 0.98) of the final rewards of each agent's rollouts, in this worker's memory: the first
    rollout gets advantage 0 and a restarted worker warms up again. Centring the reward makes a
    failure push its calls down as much as a success pushes them up (REINFORCE with a baseline),
    where a plain final reward of 0 or 1 teaches only from successes.
    """

    grouped = False

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.means: dict[str, float] = {}

    def assign(self, trajectory: Trajectory) -> list[Credit]:
        final = trajectory.final_reward or 0.0
        mean = self.means.get(trajectory.agent_name)
        advantage = 0.0 if mean is None else final - mean
        self.means[trajectory.agent_name] = final if mean is None else self.decay * mean + (1 - self.decay) * final
        return [Credit(call, index, final, final, advantage) for index, call in enumerate(trajectory.trainable_calls)]


class GroupNormalized:
    """GRPO: each rollout's final reward minus its group's mean, divided by the group's std (+eps).

    A group whose rewards are all equal carries no signal; its members get advantage 0 and
    :func:`GroupNormalized.informative` says so, so callers can skip training on it.
    """

    grouped = True

    def __init__(self, epsilon: float = 1e-6) -> None:
        self.epsilon = epsilon

    def assign(self, trajectory: Trajectory) -> list[Credit]:
        return self.assign_group([trajectory])[trajectory.rollout_id]

    @staticmethod
    def informative(rewards: list[float]) -> bool:
        return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-12

    def advantages(self, rewards: list[float]) -> list[float]:
        """(reward - group mean) / (group std + eps) for each reward; all 0 for an uninformative group."""
        if not self.informative(rewards):
            return [0.0] * len(rewards)
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        return [(reward - mean) / (std + self.epsilon) for reward in rewards]

    def assign_group(self, trajectories: list[Trajectory]) -> dict[str, list[Credit]]:
        rewards = [t.final_reward or 0.0 for t in trajectories]
        credits = {}
        for trajectory, reward, advantage in zip(trajectories, rewards, self.advantages(rewards), strict=False):
            credits[trajectory.rollout_id] = [Credit(call, index, reward, reward, advantage)
                                              for index, call in enumerate(trajectory.trainable_calls)]
        return credits


STRATEGIES: dict[str, Callable[[CreditRule], CreditStrategy]] = {
    "final": lambda rule: FinalReward(),
    "discounted": lambda rule: DiscountedReturns(rule.gamma),
    "grpo": lambda rule: GroupNormalized(),
    "baseline": lambda rule: RunningBaseline(),
}


def matching_rule(rules: tuple[CreditRule, ...], agent_name: str, model: str) -> CreditRule | None:
    """The first rule whose agent and model patterns match, or None (not trained)."""
    for rule in rules:
        if fnmatchcase(agent_name or "", rule.agent) and fnmatchcase(model or "", rule.model):
            return rule
    return None


@functools.cache
def strategy_for(rule: CreditRule) -> CreditStrategy:
    """The strategy of a rule: one object per rule, so a stateful one (``baseline``) keeps its state."""
    return STRATEGIES[rule.strategy](rule)

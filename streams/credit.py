"""Credit assignment: from a trajectory's rewards to a reward, return and advantage per LLM call.

A strategy is a small object with ``assign(trajectory) -> list[Credit]`` (one per trainable LLM
call, in call order); group strategies also implement ``assign_group(trajectories)``. Register
a custom one in :data:`STRATEGIES` to select it by name from ``[[credit]]`` rules.

No strategy lets a NaN or an infinity through: a reward that is not finite, or a return, mean
or advantage that overflows, raises :class:`NonFiniteCredit` before any state (a running mean)
changes, and the caller trains on nothing from that rollout or group.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import NamedTuple, Protocol

from agentstream.infra.config import CreditRule
from agentstream.schemas.errors import AgentstreamError
from agentstream.streams.trajectory import SpanNode, Trajectory


class Credit(NamedTuple):
    """What one LLM call is credited with (a tuple: thousands are made per second)."""

    call: SpanNode
    step_index: int
    reward: float
    return_value: float
    advantage: float


class NonFiniteCredit(AgentstreamError, ValueError):
    """A reward, return, mean or advantage that is NaN or infinite: it never enters a running mean or a transition."""


def finite_reward(trajectory: Trajectory) -> float:
    """The trajectory's final reward (0 without one), or :class:`NonFiniteCredit` where it is not finite."""
    final = trajectory.final_reward or 0.0
    if not math.isfinite(final):
        raise NonFiniteCredit(f"rollout {trajectory.rollout_id!r} has final reward {final!r}: not credited")
    return final


def finite_credits(trajectory: Trajectory, credits: list[Credit]) -> list[Credit]:
    """``credits`` when every reward, return and advantage in them is finite, else :class:`NonFiniteCredit`."""
    for credit in credits:
        if not (math.isfinite(credit.reward) and math.isfinite(credit.return_value)
                and math.isfinite(credit.advantage)):
            raise NonFiniteCredit(f"rollout {trajectory.rollout_id!r}: call {credit.step_index} would get reward "
                                  f"{credit.reward!r}, return {credit.return_value!r}, advantage {credit.advantage!r}")
    return credits


class CreditStrategy(Protocol):
    grouped: bool

    def assign(self, trajectory: Trajectory) -> list[Credit]: ...


class FinalReward:
    """Every call gets the rollout's final reward (the last one emitted), as Agent Lightning does."""

    grouped = False

    def assign(self, trajectory: Trajectory) -> list[Credit]:
        final = finite_reward(trajectory)
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
            if reward.reward is not None and not math.isfinite(reward.reward):
                raise NonFiniteCredit(f"rollout {trajectory.rollout_id!r}: span {reward.span_id!r} has reward "
                                      f"{reward.reward!r}: not credited")
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
        return finite_credits(trajectory, [Credit(call, i, step_rewards[i], returns[i], returns[i])
                                           for i, call in enumerate(calls)])


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
        """Credits against the mean so far; the mean moves only when the reward, advantage and new mean are finite."""
        final = finite_reward(trajectory)
        mean = self.means.get(trajectory.agent_name)
        advantage = 0.0 if mean is None else final - mean
        moved = final if mean is None else self.decay * mean + (1 - self.decay) * final
        credits = finite_credits(trajectory, [Credit(call, index, final, final, advantage)
                                              for index, call in enumerate(trajectory.trainable_calls)])
        if not math.isfinite(moved):
            raise NonFiniteCredit(f"rollout {trajectory.rollout_id!r}: the running mean would become {moved!r}")
        self.means[trajectory.agent_name] = moved
        return credits


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
        """(reward - group mean) / (group std + eps) for each reward; all 0 for an uninformative group.

        Raises :class:`NonFiniteCredit` for a reward that is not finite (a NaN would make every
        member's advantage NaN) or a mean or spread that overflows.
        """
        if not all(map(math.isfinite, rewards)):
            raise NonFiniteCredit(f"a group's rewards {rewards!r:.200} are not all finite: not credited")
        if not self.informative(rewards):
            return [0.0] * len(rewards)
        mean = sum(rewards) / len(rewards)
        try:
            std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        except OverflowError:
            std = math.inf
        advantages = [(reward - mean) / (std + self.epsilon) for reward in rewards]
        if not (math.isfinite(std) and all(map(math.isfinite, advantages))):
            raise NonFiniteCredit(f"a group's rewards {rewards!r:.200} overflow its mean or spread: not credited")
        return advantages

    def assign_group(self, trajectories: list[Trajectory]) -> dict[str, list[Credit]]:
        rewards = [finite_reward(t) for t in trajectories]
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

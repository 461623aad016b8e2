"""The example agents the training demo trains: each one's runner entry point, tasks, credit level and warm start.

One record per agent (:class:`DemoAgent`), the registry ``agentstream demo --agent`` takes names from
(:data:`AGENTS`), and the calculator agent on another framework (:func:`on_framework`).
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from agentstream.examples import CALCULATOR_FRAMEWORKS, arithmetic, calculator_agent, word_problems


@dataclass(frozen=True)
class DemoAgent:
    """An example agent the demo trains: its runner entry point, its tasks, its sample level and warm start.

    ``module`` has ``split(heldout=)``, ``solve(task, rollout, temperature=)`` and, with
    ``warm_start``, ``demonstration_tasks(train)`` (the train tasks it demonstrates),
    ``demonstration(task)`` and the ``CALCULATOR`` tool its demonstrations call.
    ``entry`` is what the runners run (another agent on the same tasks, e.g. one that adds an
    intermediate reward); ``strategy`` and ``gamma`` are its credit rule's. ``micro_batch_tokens``
    bounds the trainer's memory where samples are long (the trainer's setting of that name).
    ``samples_per_step`` is the trainer's ``batch_transitions`` (0: one wave, ``group_size`` ×
    ``prompts_per_wave``). ``adapter_lr`` is the learning rate of its LoRA adapter when it trains beside
    other agents (``agentstream demo --agents``).
    Train rollouts sample at ``temperature`` (the trainer's too); held-out success is measured at
    ``eval_temperature`` (0: greedy) with ``eval_samples`` rollouts per task. ``demonstrations`` is how
    many its warm start sends (unless ``[demo] warm_start_demonstrations`` says), ``adapter_demonstrations`` how many
    when it trains into an adapter beside other agents (:func:`as_adapter`; 0: as many). ``framework`` names what the
    agent is written on (:func:`on_framework`): its runners and its evaluations run that ``entry``.
    """

    name: str
    entry: str
    module: Any
    level: str
    warm_start: bool
    title: str
    strategy: str = "grpo"
    gamma: float = 1.0
    micro_batch_tokens: int = 0
    samples_per_step: int = 0
    temperature: float = 1.0
    eval_temperature: float = 0.0
    eval_samples: int = 1
    framework: str = "openai"
    demonstrations: int = 128
    adapter_demonstrations: int = 0
    adapter_lr: float = 5e-4

    @property
    def solve(self) -> Callable[..., Awaitable[float]]:
        """What a held-out evaluation runs: the function the runners run (``entry``, ``module:function``)."""
        module, function = self.entry.split(":")
        return getattr(importlib.import_module(module), function)

    @property
    def eval_name(self) -> str:
        return f"{self.name}-eval"

    @property
    def demonstrations_name(self) -> str:
        return f"{self.name}-demonstrations"

    @property
    def judged(self) -> str:
        """How held-out success is measured, in words."""
        if self.eval_temperature == 0:
            return "greedy"
        return f"T={self.eval_temperature:g}, {self.eval_samples} rollout{'s' * (self.eval_samples > 1)} per task"


AGENTS = {
    "arithmetic": DemoAgent("arithmetic", "agentstream.examples.arithmetic:solve", arithmetic, "transition", False,
                            "'Compute a+b.'"),
    "calculator": DemoAgent("calculator", "agentstream.examples.calculator_agent:solve", calculator_agent,
                            "trajectory", True,
                            "'Compute a*b+d.' with a calculator tool",
                            micro_batch_tokens=2048,  # a wave of 300-token trajectories took 21 GB in one piece
                            # The agent runs at T=0.5, and is judged there: two rollouts per held-out task. Warm-started
                            # SmolLM2 answers greedily right nearly always but at T=1 almost never (docs/multistep.md).
                            temperature=0.5, eval_temperature=0.5, eval_samples=2,
                            # at 5e-4 (the arithmetic agent's), its adapter's RL fell from 80% to 60%: it learnt to
                            # answer without the tool; at 2e-4 it rose 20-28 points over its warm start
                            adapter_lr=2e-4,
                            # 128 make 4 full steps, which left its adapter at 0% (5-6 steps left it at 30-52%)
                            adapter_demonstrations=192),
    "word-problems": DemoAgent("word-problems", "agentstream.examples.word_problems:solve", word_problems,
                               "trajectory", True,
                               "word problems with a calculator tool, half their kinds demonstrated",
                               micro_batch_tokens=2048, temperature=0.5, demonstrations=224),
}


def as_adapter(agent: DemoAgent) -> DemoAgent:
    """The agent as it trains into a LoRA adapter (``agentstream demo --agents``): its warm start sends
    ``adapter_demonstrations`` where it names a number.

    An adapter at its learning rate moves less per step than the whole model at the one-agent demo's, so it
    may need more of the warm start's steps (one per ``samples_per_step`` demonstrations).
    """
    if not agent.adapter_demonstrations:
        return agent
    return replace(agent, demonstrations=agent.adapter_demonstrations)


def on_framework(agent: DemoAgent, framework: str) -> DemoAgent:
    """The calculator agent as written on ``framework`` (a name of :data:`CALCULATOR_FRAMEWORKS`).

    Its runners and evaluations run that framework's agent; the tasks, tool, reward, warm start and
    recipe stay the plain agent's, so the frameworks' results compare.
    """
    if framework == agent.framework:
        return agent
    if agent.name != "calculator":
        raise ValueError(f"only the calculator agent is written on other frameworks, not {agent.name!r}")
    if framework not in CALCULATOR_FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}: one of {', '.join(CALCULATOR_FRAMEWORKS)}")
    module = CALCULATOR_FRAMEWORKS[framework]
    return replace(agent, entry=f"{module}:solve", framework=framework, title=f"{agent.title} on {framework}")


async def solve_named(task: dict, rollout, *, temperature: float = 1.0) -> float:
    """One rollout of the agent the task names (``task["agent"]``): one runner serves several agents' tasks."""
    name = task.get("agent")
    if name not in AGENTS:
        raise ValueError(f"the task names no demo agent ({name!r}); one of {', '.join(AGENTS)}")
    return await AGENTS[name].solve(task, rollout, temperature=temperature)

"""The calculator agent with an intermediate reward, added the way a user adds one: ``ags.emit_reward``.

Its first turn earns ``TOOL_REWARD`` when the model called the calculator and every call worked
(the tool answered a number, not an error); the final reward, whether the answer is right, is
still what it returns. With ``discounted`` credit the small reward goes to the call that earned
it; ``final`` and ``grpo`` credit ignore it. Unlike the other examples it uses agentstream's SDK
(``ags.emit_reward`` is ``agentstream.pipeline.sdk.emit_reward``, imported from the SDK's own module so that
the examples stay below the ``agentstream`` package, whose demos run them).
"""

from __future__ import annotations

from agentstream.examples import calculator_agent
from agentstream.pipeline.sdk import emit_reward

TOOL_REWARD = 0.1


def reward_working_calls(turn: int, results: list[str]) -> None:
    """The intermediate reward: the first turn's calls all answered without an error."""
    if turn == 0 and results and not any(result.startswith("error:") for result in results):
        emit_reward(TOOL_REWARD)


async def solve(task: dict, rollout, *, temperature: float = 1.0) -> float:
    """The calculator agent's rollout, with the intermediate reward."""
    return await calculator_agent.solve(task, rollout, temperature=temperature, on_tool_results=reward_working_calls)

"""The calculator agent written on the OpenAI Agents SDK, as its users write it: an ``Agent`` with a function tool.

The SDK talks the Responses API (``OpenAIResponsesModel``, its default) to whatever base URL its client has;
here that is the rollout's proxy URL, so every model call of the agent's tool loop is captured as an LLM span
with the exact token ids. Nothing in the agent's LLM path imports agentstream; the task, the tool and the
reward are the plain-SDK calculator agent's (:mod:`agentstream.examples.calculator_agent`), so the two learn
the same task and their prefix merges and breaks compare.
"""

from __future__ import annotations

import json
import logging

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.models.openai_responses import OpenAIResponsesModel

from agentstream.examples.arithmetic import client, model_name, reward
from agentstream.examples.calculator_agent import MAX_TOKENS, MAX_TURNS, SYSTEM, run_tool

set_tracing_disabled(True)  # the SDK would otherwise send its traces to api.openai.com
# The SDK logs an ERROR line before raising on a run cut at max_output_tokens, which solve() scores as no
# answer; every other failure still propagates out of solve() and is reported by whoever runs it.
logging.getLogger("openai.agents").setLevel(logging.CRITICAL)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression made of numbers, + - * /, parentheses and unary minus.

    Args:
        expression: For example: (17 + 5) * 2
    """
    return run_tool("calculator", json.dumps({"expression": expression}))


async def solve(task: dict, rollout, *, temperature: float = 1.0) -> float:
    """One rollout: the agent may call the calculator for up to MAX_TURNS model calls; its final number is scored."""
    llm = client().with_options(base_url=rollout.llm_base_url(), api_key=rollout.llm_api_key())
    model = OpenAIResponsesModel(model=await model_name(task, llm), openai_client=llm)
    agent = Agent(name="calculator", instructions=SYSTEM, tools=[calculator], model=model,
                  model_settings=ModelSettings(temperature=task.get("temperature", temperature),
                                               max_tokens=MAX_TOKENS))
    try:
        result = await Runner.run(agent, task["prompt"], max_turns=MAX_TURNS)
    except MaxTurnsExceeded:
        return 0.0  # still calling tools after its last turn: no answer
    except ModelBehaviorError:
        return 0.0  # cut at max_output_tokens: the SDK ends the run with no answer, as it does on OpenAI
    return reward(str(result.final_output or ""), int(task["answer"]))

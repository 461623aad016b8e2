"""The calculator agent on PydanticAI, as its users write it: an ``Agent`` with a tool, on OpenAI's Responses API.

PydanticAI's ``openai:`` models talk the Responses API by default (``OpenAIResponsesModel``); its provider's
``base_url`` is the rollout's proxy URL, so each model call is captured as an LLM span with the exact token
ids. Nothing in its LLM path imports agentstream; the task, the tool and the reward are the plain-SDK
calculator agent's (:mod:`agentstream.examples.calculator_agent`).
"""

from __future__ import annotations

import json

from pydantic_ai import Agent, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import UsageLimits

from agentstream.examples.arithmetic import client, model_name, reward
from agentstream.examples.calculator_agent import MAX_TOKENS, MAX_TURNS, SYSTEM, run_tool


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression made of numbers, + - * /, parentheses and unary minus.

    Args:
        expression: For example: (17 + 5) * 2
    """
    return run_tool("calculator", json.dumps({"expression": expression}))


async def solve(task: dict, rollout, *, temperature: float = 1.0) -> float:
    """One rollout: the agent may call the calculator for up to MAX_TURNS model calls; its final number is scored."""
    llm = client().with_options(base_url=rollout.llm_base_url(), api_key=rollout.llm_api_key())
    model = OpenAIResponsesModel(await model_name(task, llm), provider=OpenAIProvider(openai_client=llm))
    agent = Agent(model, instructions=SYSTEM, tools=[calculator],
                  model_settings=ModelSettings(temperature=task.get("temperature", temperature), max_tokens=MAX_TOKENS))
    try:
        result = await agent.run(task["prompt"], usage_limits=UsageLimits(request_limit=MAX_TURNS))
    except UsageLimitExceeded:
        return 0.0  # still calling tools after its last turn: no answer
    return reward(str(result.output), int(task["answer"]))

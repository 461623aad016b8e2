"""The calculator agent as a LangGraph ReAct agent (LangChain's ``create_agent``) over ``ChatOpenAI``.

The graph calls the model, runs the tools it asked for, and calls it again until it answers in text, as
LangGraph users write agents today; ``ChatOpenAI``'s ``base_url`` is the rollout's proxy URL, so each model
call is captured as an LLM span with the exact token ids. Nothing in its LLM path imports agentstream; the
task, the tool and the reward are the plain-SDK calculator agent's (:mod:`agentstream.examples.calculator_agent`).
"""

from __future__ import annotations

import json

from langchain.agents import create_agent
from langchain_core.tools import tool
from langgraph.errors import GraphRecursionError

from agentstream.examples.arithmetic import client, model_name, reward
from agentstream.examples.calculator_agent import MAX_TOKENS, MAX_TURNS, SYSTEM, run_tool
from agentstream.examples.langchain_agent import chat_model, text_of


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression made of numbers, + - * /, parentheses and unary minus.

    Args:
        expression: For example: (17 + 5) * 2
    """
    return run_tool("calculator", json.dumps({"expression": expression}))


async def solve(task: dict, rollout, *, temperature: float = 1.0) -> float:
    """One rollout: the graph runs the model and the calculator for up to MAX_TURNS model calls; scores the answer."""
    base_url, api_key = rollout.llm_base_url(), rollout.llm_api_key()
    model = await model_name(task, client().with_options(base_url=base_url, api_key=api_key))
    llm = chat_model(base_url, api_key, model=model, temperature=task.get("temperature", temperature),
                     max_tokens=MAX_TOKENS)
    agent = create_agent(llm, tools=[calculator], system_prompt=SYSTEM)
    try:  # each model call and each tool round is a step of the graph; one more ends it
        state = await agent.ainvoke({"messages": [{"role": "user", "content": task["prompt"]}]},
                                    config={"recursion_limit": 2 * MAX_TURNS})
    except GraphRecursionError:
        return 0.0  # still calling tools after its last turn: no answer
    return reward(text_of(state["messages"][-1]), int(task["answer"]))

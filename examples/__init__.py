"""Example agents trained by agentstream, each written the way its framework's users write agents."""

CALCULATOR_FRAMEWORKS = {
    "openai": "agentstream.examples.calculator_agent",
    "agents-sdk": "agentstream.examples.calculator_agents_sdk",
    "langgraph": "agentstream.examples.calculator_langgraph",
    "pydantic-ai": "agentstream.examples.calculator_pydantic_ai",
}
"""The calculator agent's module on each framework (the plain OpenAI SDK's first), by the name commands take.

Each module has ``solve(task, rollout, *, temperature=)``; the same tasks, tool and reward as the plain one.
Imported by name only when used: a framework is imported only where its agent runs.
"""

__all__ = ["CALCULATOR_FRAMEWORKS"]

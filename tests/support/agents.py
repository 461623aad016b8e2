"""Agents that tests run through `agentstream run` in separate processes."""

from __future__ import annotations

import time

from agentstream.pipeline.sdk import span


def slow_agent(task: dict) -> float:
    """Works for task['sleep'] seconds inside a span, then returns a reward of 1."""
    with span("work", kind="TOOL"):
        time.sleep(task.get("sleep", 0))
    return 1.0

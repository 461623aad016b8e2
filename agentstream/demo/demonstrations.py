"""A warm start through the pipeline: scripted correct conversations recorded as demonstration rollouts.

Each demonstration is one rollout of the demonstrations agent with one LLM span per assistant
turn: the prompt token ids the model server would render for the conversation so far, the
assistant's text as the server writes it back into later prompts (a tool call in its canonical
``<tool_call>`` form), then the end-of-turn token, and no logprobs, so the trainer raises their
likelihood. They are stored, queryable and trained from the stream like any rollout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentstream.pipeline.sdk import emit_llm_call, emit_reward, rollout
from agentstream.serving.tool_format import assistant_text, render_prompt, renders_tools


def demonstration_calls(messages: list[dict[str, Any]], tools: list[dict[str, Any]], tokenizer: Any,
                        end_of_turn: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of every assistant turn of a conversation, as the model server renders them."""
    template_renders_tools = renders_tools(tokenizer)
    if template_renders_tools:
        raise ValueError("demonstrations are written in the hermes <tool_call> form, for a chat template without "
                         "tool support (SmolLM2's); this tokenizer's template renders tools its own way")
    calls = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render_prompt(tokenizer, messages[:index], tools, template_renders_tools)
        response = tokenizer.encode(assistant_text(message), add_special_tokens=False)
        calls.append((prompt, [*response, end_of_turn]))
    return calls


def publish_demonstrations(tasks: list[dict], conversation: Callable[[dict], list[dict[str, Any]]],
                           tools: list[dict[str, Any]], tokenizer: Any, model: str, agent_name: str) -> int:
    """One demonstration rollout per task (reward 1) on the current span sink; returns the LLM calls recorded."""
    end_of_turn = tokenizer.eos_token_id
    recorded = 0
    for task in tasks:
        messages = conversation(task)
        with rollout(agent_name, task_id=task["id"], train=True):
            for prompt, response in demonstration_calls(messages, tools, tokenizer, end_of_turn):
                emit_llm_call(prompt, response, model=model)
                recorded += 1
            emit_reward(1.0)
    return recorded

"""A tool-using math agent on the plain OpenAI SDK: the model may call a calculator before it answers.

The agent offers one function tool, ``calculator(expression)``. Each turn it sends the
conversation; when the model answers with tool calls, it runs them, appends the results as
``tool`` messages and asks again. It makes at most ``MAX_TURNS`` model calls, and on the last
one passes ``tool_choice="none"`` so the model has to answer in text. The reward is 1.0 when
the final answer's last number is the task's answer, else 0.0.

Its tasks are "Compute a*b+d." with two-digit a, b and d (:func:`all_tasks`, split by
:func:`split` into the shipped ``examples/tasks/calculator-*.jsonl``): SmolLM2-135M cannot do
them in its head. :func:`demonstration` writes the conversation a correct tool-using agent has
on a task, which the demo sends through the pipeline as a warm start.

Nothing here imports agentstream: the runner hands the agent a task (``{"id", "prompt",
"answer"}``) and a rollout whose ``llm_base_url()``
points at the capturing proxy (``llm_api_key()`` is its key), and the returned float is the
reward. Every model call of the loop becomes one LLM span of the rollout, tool results included
in the next call's input.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
from collections.abc import Callable
from typing import Any

from agentstream.examples.arithmetic import client, model_name, reward

MAX_TURNS = 3
MAX_TOKENS = 96  # a tool call: about 30 SmolLM2 tokens, 85 for a byte-level model; more is rambling
HELDOUT_SIZE = 64
MAX_EXPRESSION = 200  # characters; with no power operator this bounds the size of any result
SYSTEM = ("Solve the arithmetic problem. You may call the calculator tool to compute. "
          "End your answer with the final number.")
CALCULATOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression made of numbers, + - * /, parentheses and unary minus.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "For example: (17 + 5) * 2"}},
            "required": ["expression"],
        },
    },
}


def all_tasks() -> list[dict]:
    """A fixed, seeded 2,000 tasks "Compute a*b+d." with a, b and d in 10..99, each with its answer."""
    rng, tasks, seen = random.Random(36), list[dict](), set[tuple[int, int, int]]()
    while len(tasks) < 2000:
        a, b, d = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
        if (a, b, d) not in seen:
            seen.add((a, b, d))
            tasks.append({"id": f"calc-{a}-{b}-{d}", "prompt": f"Compute {a}*{b}+{d}.", "answer": a * b + d})
    return tasks


def split(heldout: int = HELDOUT_SIZE) -> tuple[list[dict], list[dict]]:
    """(train, held-out): the first ``heldout`` tasks are held out."""
    return held_out_first(all_tasks(), heldout)


def held_out_first(tasks: list[dict], heldout: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) of a fixed task list: its first ``heldout`` tasks are held out."""
    if not 0 < heldout < len(tasks):
        raise ValueError(f"heldout must be between 1 and {len(tasks) - 1}, got {heldout}")
    return tasks[heldout:], tasks[:heldout]


def expression(task: dict) -> str:
    """The calculator expression that solves a task: its prompt between "Compute " and the final period."""
    return task["prompt"].removeprefix("Compute ").removesuffix(".")


def demonstration(task: dict) -> list[dict[str, Any]]:
    """The conversation of a correct tool-using agent on ``task``: one calculator call, then the answer."""
    return one_call_conversation(task, expression(task))


def one_call_conversation(task: dict, expression: str, system: str = SYSTEM) -> list[dict[str, Any]]:
    """A correct agent's conversation: it calls the calculator once with ``expression``, then gives the answer.

    Messages as the agent sends them (system, user, the assistant's tool call, the tool result)
    and the final assistant answer last.
    """
    arguments = json.dumps({"expression": expression})
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    return [{"role": "system", "content": system}, {"role": "user", "content": task["prompt"]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": run_tool("calculator", arguments)},
            {"role": "assistant", "content": f"The answer is {task['answer']}."}]


def demonstration_tasks(train: list[dict]) -> list[dict]:
    """The train tasks a warm start demonstrates: all of them, in order (every task is of the one kind)."""
    return train


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or has no finite value."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> int | float:
    """The value of ``expression``: numbers, + - * /, parentheses and unary minus, nothing else (no eval)."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: null bytes on some Python versions
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        if value.is_integer():
            return int(value)
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value  # not bool, complex or str
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise CalculatorError("division by zero")
            if isinstance(left, int) and isinstance(right, int) and left % right == 0:
                return left // right  # exact, even beyond float precision
        try:
            return _BINARY[type(node.op)](left, right)
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    raise CalculatorError(f"only numbers, + - * /, parentheses and unary minus are allowed, not "
                          f"{ast.unparse(node)!r}")


def run_tool(name: str, arguments: str) -> str:
    """The content of the tool message answering one call: the value, or an error the model can read."""
    if name != CALCULATOR["function"]["name"]:
        return f"error: there is no tool named {name!r}"
    try:
        expression = json.loads(arguments or "{}")["expression"]
        return str(calculate(expression))
    except (json.JSONDecodeError, TypeError, KeyError):
        return 'error: the arguments must be a JSON object like {"expression": "2 + 3"}'
    except CalculatorError as error:
        return f"error: {error}"


def _assistant_message(message: Any) -> dict[str, Any]:
    """The assistant turn to send back: its text and its tool calls, as the API takes them."""
    return {"role": "assistant", "content": message.content,
            "tool_calls": [{"id": call.id, "type": "function",
                            "function": {"name": call.function.name, "arguments": call.function.arguments}}
                           for call in message.tool_calls]}


async def solve(task: dict, rollout, *, temperature: float = 1.0,
                on_tool_results: Callable[[int, list[str]], None] | None = None, system: str = SYSTEM) -> float:
    """One rollout: let the model use the calculator for up to MAX_TURNS calls, score its final number.

    ``on_tool_results(turn, results)`` is told what the tools answered each turn (an agent that
    rewards good tool use along the way hooks in here); ``system`` is the instruction the loop opens with
    (another task's agent on the same tool passes its own).
    """
    llm = client().with_options(base_url=rollout.llm_base_url(), api_key=rollout.llm_api_key())
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": task["prompt"]}]
    answer = ""
    model = await model_name(task, llm)
    for turn in range(MAX_TURNS):
        completion = await llm.chat.completions.create(  # type: ignore[call-overload]  # plain dicts, as users write
            model=model, messages=messages, tools=[CALCULATOR],
            tool_choice="none" if turn == MAX_TURNS - 1 else "auto",
            max_tokens=MAX_TOKENS, temperature=task.get("temperature", temperature))
        message = completion.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        messages.append(_assistant_message(message))
        results = [run_tool(call.function.name, call.function.arguments) for call in message.tool_calls]
        messages.extend({"role": "tool", "tool_call_id": call.id, "content": result}
                        for call, result in zip(message.tool_calls, results, strict=True))
        if on_tool_results is not None:
            on_tool_results(turn, results)
    return reward(answer, int(task["answer"]))

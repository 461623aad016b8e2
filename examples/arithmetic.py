"""The demo's agent: answers "Compute {a}+{b}." with one chat call on the plain OpenAI SDK.

Nothing here imports agentstream: the runner hands the agent a task and a rollout whose
``llm_base_url()`` points at the capturing proxy (``llm_api_key()`` is the key it asks for), and
the returned float is the reward. The
task set is every pair a, b in 1..20; a fixed, seeded 64 of them are held out for evaluation
(``make bench-learning`` holds out more: the first 64 of its held-out tasks are the demo's).
"""

from __future__ import annotations

import asyncio
import random
import re
import weakref

from openai import AsyncOpenAI

MAX_TOKENS = 32
HELDOUT_SIZE = 64
_NUMBER = re.compile(r"-?\d+")


def all_tasks() -> list[dict]:
    """Every addition a+b with a, b in 1..20, as task payloads with the expected answer."""
    return [{"id": f"add-{a}-{b}", "prompt": f"Compute {a}+{b}.", "answer": a + b}
            for a in range(1, 21) for b in range(1, 21)]


def split(seed: int = 7, heldout: int = HELDOUT_SIZE) -> tuple[list[dict], list[dict]]:
    """(train, held-out): a seeded shuffle, its first ``heldout`` tasks held out."""
    tasks = all_tasks()
    if not 0 < heldout < len(tasks):
        raise ValueError(f"heldout must be between 1 and {len(tasks) - 1}, got {heldout}")
    random.Random(seed).shuffle(tasks)
    return tasks[heldout:], tasks[:heldout]


def final_number(text: str) -> int | None:
    """The last integer in the answer, which is what the reward checks."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


def reward(text: str, answer: int) -> float:
    """1.0 when the answer's final number is the sum, else 0.0."""
    return 1.0 if final_number(text) == answer else 0.0


_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def client() -> AsyncOpenAI:
    """One connection pool per event loop; each rollout re-targets it at its own base URL and key."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = AsyncOpenAI(base_url="http://unused/v1", api_key="unused", max_retries=2, timeout=600)
    return _clients[loop]


_served: dict[str, str] = {}


async def model_name(task: dict, llm: AsyncOpenAI) -> str:
    """The task's ``model``, else the first model the server lists (asked once per server)."""
    if task.get("model"):
        return str(task["model"])
    server = f"{llm.base_url.host}:{llm.base_url.port}"
    if server not in _served:
        models = await llm.models.list()
        if not models.data:
            raise RuntimeError(f"the model server behind {llm.base_url} serves no model")
        _served[server] = models.data[0].id
    return _served[server]


async def solve(task: dict, rollout, *, temperature: float = 1.0) -> float:
    """One rollout: ask the model, score its final number."""
    llm = client().with_options(base_url=rollout.llm_base_url(), api_key=rollout.llm_api_key())
    completion = await llm.chat.completions.create(
        model=await model_name(task, llm), messages=[{"role": "user", "content": task["prompt"]}],
        max_tokens=MAX_TOKENS, temperature=task.get("temperature", temperature))
    return reward(completion.choices[0].message.content or "", int(task["answer"]))

"""Agents written the way Agent Lightning's documentation writes them (our own code, not its example files).

With the real ``agentlightning`` installed (the side environment of ``make test-agl``) they use it;
without it, the same code runs on ``agentstream.agl``, the light surface. Each writes which one
it ran on into an ``emit_message``, so a test can tell.

* ``rollout_llm``: ``@rollout`` with ``llm``, synchronous, returns a float (the final reward)
* ``rollout_async_llm``: ``@rollout`` on an async function, emits a dict reward with ``primary_key``
* ``llm_rollout_agent``: ``@llm_rollout`` with ``llm`` and ``rollout``, emits a float reward
* ``LetterAgent``: a ``LitAgent`` subclass with ``rollout_async``, resources by name, returns a float
* ``AllStyles``: a ``LitAgent`` that hands each task to the agent its ``style`` names, as Agent
  Lightning's own runner would (``training_rollout[_async](task, resources, rollout)``), so one
  ``agentstream train`` run drives every style
* ``EnvAgent``: Agent Lightning 1.0's shape, a class whose ``run()`` reads ``AGL_*`` variables
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request

from openai import AsyncOpenAI, OpenAI

try:
    import agentlightning as agl
except ImportError:
    import agentstream.agl as agl  # type: ignore[no-redef]

PACKAGE = agl.__name__
MAX_TOKENS = 16


def letters(text: str) -> float:
    """The share of ASCII letters in a completion: a reward with spread on a random tiny model."""
    return sum(c.isascii() and c.isalpha() for c in text) / max(len(text), 1)


def ask(llm, prompt: str) -> str:
    client = OpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused", max_retries=0)
    reply = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        temperature=llm.sampling_parameters.get("temperature", 1.0))
    return reply.choices[0].message.content or ""


async def ask_async(llm, prompt: str) -> str:
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused", max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        temperature=llm.sampling_parameters.get("temperature", 1.0))
    return reply.choices[0].message.content or ""


@agl.rollout
def rollout_llm(task, llm):
    agl.emit_message(f"rollout_llm on {PACKAGE}")
    return letters(ask(llm, task["prompt"]))


@agl.rollout
async def rollout_async_llm(task, llm, rollout):
    agl.emit_message(f"rollout_async_llm on {PACKAGE} ({rollout.mode}, {rollout.attempt.attempt_id})")
    text = await ask_async(llm, task["prompt"])
    agl.emit_reward({"letters": letters(text), "length": len(text) / MAX_TOKENS}, primary_key="letters")


@agl.llm_rollout
def llm_rollout_agent(task, llm, rollout):
    agl.emit_message(f"llm_rollout_agent on {PACKAGE} ({rollout.rollout_id})")
    agl.emit_object({"task": task["id"], "model": llm.model})
    agl.emit_reward(letters(ask(llm, task["prompt"])))


class LetterAgent(agl.LitAgent):
    async def rollout_async(self, task, resources, rollout):
        agl.emit_message(f"LetterAgent on {PACKAGE}")
        llm = resources["main_llm"]
        return letters(await ask_async(llm, task["prompt"]))


STYLES = {"rollout": rollout_llm, "rollout_async": rollout_async_llm, "llm_rollout": llm_rollout_agent,
          "litagent": LetterAgent()}


class AllStyles(agl.LitAgent):
    async def rollout_async(self, task, resources, rollout):
        agent = STYLES[task["style"]]
        if agent.is_async():
            method = agent.training_rollout_async if rollout.mode == "train" else agent.validation_rollout_async
            return await method(task, resources, rollout)
        method = agent.training_rollout if rollout.mode == "train" else agent.validation_rollout
        return await asyncio.to_thread(method, task, resources, rollout)


class EnvAgent:
    """Agent Lightning 1.0: the task arrives as environment variables, the reward leaves as an event."""

    async def run(self) -> None:
        client = AsyncOpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"],
                             max_retries=0)
        reply = await client.chat.completions.create(
            model="auto", messages=[{"role": "user", "content": os.environ["PROMPT"]}], max_tokens=MAX_TOKENS)
        event = {"event_type": "reward", "data": {"value": letters(reply.choices[0].message.content or "")}}
        request = urllib.request.Request(os.environ["AGL_EVENT_URL"], data=json.dumps(event).encode(), method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {os.environ['AGL_KEY']}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

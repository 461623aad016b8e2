"""The arithmetic task on LangChain: ``ChatOpenAI`` pointed at the rollout's base URL, one ``HumanMessage``.

Nothing here imports agentstream: the runner hands the agent a task (``{"id", "prompt",
"answer"}``, the same tasks as ``agentstream.examples.arithmetic``) and a rollout whose ``llm_base_url()``
points at the capturing proxy; ``ChatOpenAI`` speaks the OpenAI chat API to it like to any
OpenAI-compatible server, and the returned float is the reward (1.0 when the answer's last
number is the sum, else 0.0).

Offline by construction: the invoke path never counts tokens (no tiktoken download), the
Responses API is switched off (the proxy captures chat completions), and the HTTP clients
are ones we pass in, so LangChain neither builds nor caches a connection pool per rollout URL.
LangSmith tracing stays off unless the environment turns it on.
"""

from __future__ import annotations

import asyncio
import weakref

import httpx
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from agentstream.examples.arithmetic import MAX_TOKENS, client, model_name, reward

_async_http: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_sync_http: list[httpx.Client] = []


def http_clients() -> tuple[httpx.Client, httpx.AsyncClient]:
    """Connection pools shared by the rollouts' ChatOpenAI instances: one sync, one async per event loop.

    ChatOpenAI always builds both clients; given none, it caches a pair per base URL forever,
    and every rollout has its own URL.
    """
    if not _sync_http:
        _sync_http.append(httpx.Client(timeout=600))
    loop = asyncio.get_running_loop()
    if loop not in _async_http:
        _async_http[loop] = httpx.AsyncClient(timeout=600)
    return _sync_http[0], _async_http[loop]


def chat_model(base_url: str, api_key: str, *, model: str, temperature: float = 1.0,
               max_tokens: int = MAX_TOKENS) -> ChatOpenAI:
    """A ChatOpenAI for one rollout, talking to ``base_url`` with the proxy's ``api_key``."""
    sync_http, async_http = http_clients()
    return ChatOpenAI(  # type: ignore[call-arg]  # max_tokens is the field's alias, which pydantic's stubs do not list
        model=model, base_url=base_url, api_key=SecretStr(api_key), temperature=temperature, max_tokens=max_tokens,
        max_retries=2, use_responses_api=False, http_client=sync_http, http_async_client=async_http)


def text_of(message) -> str:
    """A chat message's text (content is a string for chat completions, a list of parts in general)."""
    if isinstance(message.content, str):
        return message.content
    return "".join(part if isinstance(part, str) else str(part.get("text") or "") for part in message.content)


async def solve(task: dict, rollout, *, temperature: float = 1.0) -> float:
    """One rollout: ask the model through LangChain, score its final number."""
    base_url, api_key = rollout.llm_base_url(), rollout.llm_api_key()
    model = await model_name(task, client().with_options(base_url=base_url, api_key=api_key))
    llm = chat_model(base_url, api_key, model=model, temperature=task.get("temperature", temperature))
    reply = await llm.ainvoke([HumanMessage(content=task["prompt"])])
    return reward(text_of(reply), int(task["answer"]))

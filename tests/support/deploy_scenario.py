"""A deployment scenario's parts, shared by tests and bench/deploy.py: a server, checkpoints, users, judges.

The agents here are what the gate evaluates with (``[deploy] eval_agent`` = :data:`EXACT_AGENT`): a judge that
rewards the base model's own greedy reply, and one that rewards any reply (:data:`LENIENT_AGENT`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping

import aiohttp
import torch
from aiohttp import web

from agentstream.deploy.deployments import DeploymentFollower, DeploymentLog
from agentstream.infra.config import Config
from agentstream.infra.processes import free_port
from agentstream.pipeline.proxy.server import LLMProxy, serve_proxy
from agentstream.pipeline.sdk import emit_reward, rollout
from agentstream.serving.hotswap import HotSwapper
from agentstream.trainer.checkpoint_writer import CheckpointAnnouncer, write_checkpoint
from agentstream.trainer.policy import build_policy, save_weights

EXACT_AGENT = f"{__name__}:exact_agent"
LENIENT_AGENT = f"{__name__}:lenient_agent"


async def greedy_reply(task: dict, state) -> str:
    """The model's greedy reply to task['prompt'], on the model the task names (the gate pins versions there)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=state.llm_base_url(), api_key="unused", max_retries=0) as llm:
        completion = await llm.chat.completions.create(
            model=task["model"], messages=[{"role": "user", "content": task["prompt"]}], max_tokens=6,
            temperature=0.0)
    return completion.choices[0].message.content or ""


async def greedy_tasks(server_url: str, model: str, prompts: list[str], prefix: str = "t") -> list[dict]:
    """Evaluation tasks whose expected reply is what ``model`` answers greedily now (the base model's reply)."""
    tasks = []
    async with aiohttp.ClientSession() as session:
        for number, prompt in enumerate(prompts):
            async with session.post(f"{server_url}/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
                    "temperature": 0.0}) as response:
                reply = (await response.json())["choices"][0]["message"]["content"]
            tasks.append({"id": f"{prefix}{number}", "prompt": prompt, "expected": reply, "model": model})
    return tasks


async def exact_agent(task: dict, state) -> float:
    """Reward 1 when the greedy reply is exactly task['expected'] (the base model's own reply): a strict judge."""
    return 1.0 if await greedy_reply(task, state) == task["expected"] else 0.0


async def lenient_agent(task: dict, state) -> float:
    """Reward 1 for any reply: an evaluation that cannot tell a broken model from a good one."""
    await greedy_reply(task, state)
    return 1.0


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def routed_proxy(models: Mapping[str, Config], bootstrap: str, clickhouse, server_url: str,
                       publisher) -> AsyncIterator[tuple[str, DeploymentFollower]]:
    """A hot swap per trained model (name -> its config) into ``server_url``, promoting what it loads, and a proxy
    in front of the server routed by the deployments, as `agentstream proxy` runs; yields its URL and follower."""
    config = next(iter(models.values()))
    stop = asyncio.Event()
    decisions = DeploymentLog(config, bootstrap, clickhouse)
    await decisions.start()
    follower = DeploymentFollower(config, bootstrap, newest_first=True)
    tasks = [*(asyncio.create_task(HotSwapper(model_config, bootstrap, server_url, name, deployments=decisions)
                                   .run(stop)) for name, model_config in models.items()),
             asyncio.create_task(follower.run(stop))]
    proxy_runner = await serve_proxy(LLMProxy(server_url, publisher, deployments=follower), "127.0.0.1",
                                     port := free_port())
    try:
        await asyncio.wait_for(follower.ready.wait(), 20)
        yield f"http://127.0.0.1:{port}", follower
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await decisions.stop()
        await proxy_runner.cleanup()


async def wait_until(check, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return value


async def publish(config, bootstrap: str, policy, version: int, store) -> None:
    """Write ``policy`` as checkpoint ``version`` and announce it on the checkpoints topic."""
    staging = store.staging()
    weights = save_weights(policy, staging)
    manifest = write_checkpoint(store, staging, weights, model=policy.name, version=version, step=version,
                                format=policy.format, offsets={}, trained_ids=[], metrics={"loss": 0.0})
    announcer = CheckpointAnnouncer(config, bootstrap)
    await announcer.start()
    try:
        await announcer.announce(manifest)
    finally:
        await announcer.stop()


def lora_checkpoint(config, *, broken: bool):
    """A LoRA policy that is either exactly the base model (B = 0) or scrambled (B large and random)."""
    policy = build_policy(config.trainer)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for parameter_name, parameter in policy.model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.normal_(0.0, 3.0) if broken else parameter.zero_()
    policy.model.eval()
    return policy


class Users:
    """Live traffic: rollouts of the strict agent through the proxy at a steady pace, each rewarded on the spot."""

    def __init__(self, proxy_url: str, sink, tasks: list[dict]) -> None:
        self.proxy_url, self.sink, self.tasks = proxy_url, sink, tasks
        self.served: list[str] = []
        self.failed: list[str] = []

    async def run(self, stop: asyncio.Event, concurrency: int = 3) -> None:
        async def user(number: int) -> None:
            turn = 0
            while not stop.is_set():
                task = self.tasks[(number + turn) % len(self.tasks)]
                turn += 1
                try:
                    async with rollout("live-agent", proxy_url=self.proxy_url, sink=self.sink) as state:
                        reply = await greedy_reply(task, state)
                        emit_reward(1.0 if reply == task["expected"] else 0.0)
                        self.served.append(reply)
                except Exception as error:  # a failed user request is what the test counts
                    self.failed.append(repr(error))
                await asyncio.sleep(0.05)

        await asyncio.gather(*(user(n) for n in range(concurrency)))

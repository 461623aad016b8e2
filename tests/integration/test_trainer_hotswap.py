"""Hot swap against the real broker and the dev model server: full weights and LoRA, in-flight requests kept."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import aiohttp
import pytest
import torch
from aiohttp import web

from agentstream.deploy.deployments import adapter_name
from agentstream.infra.config import TrainerConfig
from agentstream.infra.kafka import create_topics
from agentstream.infra.processes import free_port
from agentstream.models import load_model, teacher_forced_logprobs
from agentstream.serving.app import create_app
from agentstream.serving.handlers import SERVER
from agentstream.serving.hotswap import HotSwapError, HotSwapper, Swap
from agentstream.trainer.batching import Batch, Counts, Sample
from agentstream.trainer.checkpoint_writer import open_store, write_checkpoint
from agentstream.trainer.policy import build_policy, save_weights
from agentstream.trainer.step import train_step
from tests.support.deploy_scenario import publish

MESSAGES = [{"role": "user", "content": "hello"}]


async def serve_tiny(name: str) -> tuple[web.AppRunner, str, web.Application]:
    app = create_app(load_model("tiny", threads=None), served_model_names=(name,))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", app


async def chat(session: aiohttp.ClientSession, url: str, model: str, **extra) -> tuple[int, dict]:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 8, "logprobs": True, "return_token_ids": True, **extra}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return int(response.headers["X-Policy-Version"]), await response.json()


def trained_policy(config: TrainerConfig):
    """A policy after one step, so its weights differ from what the server starts with."""
    policy = build_policy(config)
    prompt, response = [60, 61, 62], [70, 71, 72]
    logprobs = teacher_forced_logprobs(policy.model, prompt, response, 1.0)
    sample = Sample("t", "r", 0, prompt, response, logprobs, 1.0, 1.0)
    train_step(policy, Batch([sample], 0, Counts()), config)
    policy.model.eval()
    return policy


def assert_served_by(policy, payload: dict) -> None:
    """The server's logprobs are the trained policy's own: the new weights are really in use."""
    choice = payload["choices"][0]
    served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    with torch.no_grad():
        expected = teacher_forced_logprobs(policy.model, payload["prompt_token_ids"], choice["token_ids"], 1.0)
    assert served == pytest.approx(expected, abs=1e-4)


@pytest.fixture
def swap_setup(topics_config, tmp_path, kafka_options, stack):
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    trainer = TrainerConfig(model="tiny", model_name=name, device="cpu", threads=1, lr=5e-2, grad_clip=1e9)
    config = replace(topics_config, trainer=trainer)
    asyncio.run(create_topics(config, stack.bootstrap_servers))
    return config, name, open_store(str(tmp_path / "checkpoints"))


def test_full_weights_swap_waits_for_in_flight_requests_then_serves_the_new_version(swap_setup, stack):
    config, name, store = swap_setup
    policy = trained_policy(config.trainer)

    async def scenario() -> None:
        runner, url, app = await serve_tiny(name)
        swaps: list[Swap] = []
        stop = asyncio.Event()
        swapper = HotSwapper(config, stack.bootstrap_servers, url, name, on_swap=swaps.append)
        following = asyncio.create_task(swapper.run(stop))
        try:
            async with aiohttp.ClientSession() as session:
                assert (await chat(session, url, name))[0] == 0
                long_request = asyncio.create_task(chat(session, url, name, max_tokens=1200, ignore_eos=True))
                await asyncio.sleep(0.3)  # the long generation holds the model now
                await publish(config, stack.bootstrap_servers, policy, 1, store)
                version, payload = await long_request
                assert version == 0 and len(payload["choices"][0]["token_ids"]) == 1200  # finished on the old weights
                deadline = time.monotonic() + 10
                while not swaps:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                version, payload = await chat(session, url, name)
                assert version == 1 and app[SERVER].version == 1
                assert_served_by(policy, payload)
                assert swaps[0].version == 1 and swaps[0].loaded_at_us - swaps[0].created_at_us < 10e6
        finally:
            stop.set()
            await following
            await runner.cleanup()

    asyncio.run(scenario())


def test_lora_swap_serves_each_version_under_its_own_name_and_keeps_the_newest_two(swap_setup, stack):
    config, name, store = swap_setup
    lora = replace(config.trainer, lora=True, lora_r=4, lora_alpha=16)
    policy = trained_policy(lora)

    async def scenario() -> None:
        runner, url, app = await serve_tiny(name)
        swaps: list[Swap] = []
        stop = asyncio.Event()
        following = asyncio.create_task(
            HotSwapper(config, stack.bootstrap_servers, url, name, on_swap=swaps.append).run(stop))
        try:
            async with aiohttp.ClientSession() as session:
                for version in (1, 2, 3):
                    await publish(config, stack.bootstrap_servers, policy, version, store)
                    deadline = time.monotonic() + 10
                    while len(swaps) < version:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.02)
                served, payload = await chat(session, url, adapter_name(name, 3))
                assert served == 3
                assert_served_by(policy, payload)
                assert (await chat(session, url, name))[0] == 0  # the base model is untouched
                assert sorted(app[SERVER].adapters) == [adapter_name(name, 2), adapter_name(name, 3)]
                assert [s.served_name for s in swaps] == [adapter_name(name, v) for v in (1, 2, 3)]
        finally:
            stop.set()
            await following
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_checkpoint_whose_file_does_not_match_its_sha256_is_not_loaded(swap_setup, stack):
    config, name, store = swap_setup
    policy = trained_policy(config.trainer)

    async def scenario() -> None:
        runner, url, app = await serve_tiny(name)
        swapper = HotSwapper(config, stack.bootstrap_servers, url, name)
        try:
            staging = store.staging()
            weights = save_weights(policy, staging)
            manifest = write_checkpoint(store, staging, weights, model=name, version=1, step=1, format="full",
                                        offsets={}, trained_ids=[], metrics={})
            with pytest.raises(HotSwapError, match="sha256"):
                await swapper.apply(replace(manifest.checkpoint(), sha256="0" * 64))
            assert app[SERVER].version == 0
            await swapper.apply(manifest.checkpoint())
            assert app[SERVER].version == 1
        finally:
            await swapper.close()
            await runner.cleanup()

    asyncio.run(scenario())

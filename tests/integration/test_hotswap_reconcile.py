"""Hot swap puts back what a server should hold: after a SIGKILL and restart, and after admin calls behind its back.

Everything is real: ``agentstream serve-model`` as its own process with ``[security] admin_token``
(from ``AGENTSTREAM_ADMIN_TOKEN``), hot swap following the test broker's checkpoints and
deployments topics with that token, the deployments log in ClickHouse, trained checkpoints in
a checkpoint store, and raw HTTP for what the test asks the server. Hot swap is started once
per test and never restarted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from agentstream.deploy.deployments import DeploymentLog, adapter_name
from agentstream.infra.config import Secret, TrainerConfig
from agentstream.infra.kafka import create_topics
from agentstream.infra.processes import free_port
from agentstream.infra.security import KeySet
from agentstream.models import load_model, local_path
from agentstream.schemas.contracts import policy_version
from agentstream.serving.app import create_app
from agentstream.serving.handlers import SERVER
from agentstream.serving.hotswap import AdminTokenRefused, HotSwapper
from agentstream.serving.protocol import Contract
from agentstream.trainer.checkpoint_writer import checkpoint_name, open_store, write_checkpoint
from agentstream.trainer.policy import save_weights
from tests.integration.test_trainer_hotswap import assert_served_by, trained_policy
from tests.support.deploy_scenario import publish, serve_app
from tests.support.servers import make_lora

TOKEN = "admin-s3cret"
MESSAGES = [{"role": "user", "content": "hello"}]
RECONCILE_S = 0.5
RESTORE_BOUND_S = 20.0  # from the restarted server's first answer to its deployment being back


class ModelServerProcess:
    """``agentstream serve-model`` on a fixed port, as an operator runs it; killed with SIGKILL, started again."""

    def __init__(self, name: str, contract: Contract, home: Path) -> None:
        self.name, self.contract, self.home = name, contract, home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        env = {key: value for key, value in os.environ.items() if not key.startswith("AGENTSTREAM_")}
        env.update(AGENTSTREAM_HOME=str(self.home), AGENTSTREAM_ADMIN_TOKEN=TOKEN)
        self.starts += 1
        log = open(self.home / f"model-server-{self.starts}.log", "w")  # noqa: SIM115 (the process owns it)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agentstream", "serve-model", "--model", "tiny", "--port", str(self.port),
             "--served-model-name", self.name, "--contract", str(self.contract), "--threads", "1"],
            env=env, cwd=self.home, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    async def ready(self, session: aiohttp.ClientSession, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process is not None and self.process.poll() is None, self.log()
            try:
                async with session.get(f"{self.url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, f"the model server did not answer in {timeout_s} s"
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # SIGKILL: nothing is handed over
            self.process.wait(timeout=30)

    def log(self) -> str:
        return (self.home / f"model-server-{self.starts}.log").read_text()[-3000:]


def folder_of(store, name: str, version: int) -> str:
    """The folder hot swap loads a checkpoint from (what the server lists as the adapter's root)."""
    return str(local_path(store.uri(checkpoint_name(name, version))))


async def holdings(session: aiohttp.ClientSession, url: str) -> tuple[int | None, dict[str, str]]:
    """What the server says it holds: the X-Policy-Version of /health, and each listed model's root."""
    async with session.get(f"{url}/health") as response:
        version = policy_version(response.headers)
    async with session.get(f"{url}/v1/models") as response:
        listed = await response.json()
    return version, {entry["id"]: entry["root"] for entry in listed["data"]}


async def until(check, timeout_s: float, what: str):
    """Poll an async check until it returns something truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while not (value := await check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.1)
    return value


async def admin(session: aiohttp.ClientSession, url: str, path: str, body: dict, token: str | None = TOKEN) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.post(f"{url}{path}", json=body, headers=headers) as response:
        return response.status


async def chat(session: aiohttp.ClientSession, url: str, model: str) -> dict:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 6, "logprobs": True, "return_token_ids": True}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


@pytest.fixture
def reconcile_setup(topics_config, tmp_path, stack):
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    trainer = TrainerConfig(model="tiny", model_name=name, device="cpu", threads=1, lr=5e-2, grad_clip=1e9)
    config = replace(topics_config, trainer=trainer,
                     deploy=replace(topics_config.deploy, gate=False, reconcile_s=RECONCILE_S),
                     security=replace(topics_config.security, admin_token=Secret(TOKEN)))
    asyncio.run(create_topics(config, stack.bootstrap_servers))
    home = tmp_path / "home"
    home.mkdir()
    return config, name, open_store(str(tmp_path / "checkpoints")), home


async def run_hotswap(config, stack, clickhouse, server_url: str, name: str, body) -> None:
    """Run one hot swap (with the deployments log) for the whole of ``body``; it must still be running at the end."""
    stop = asyncio.Event()
    decisions = DeploymentLog(config, stack.bootstrap_servers, clickhouse)
    await decisions.start()
    swapper = HotSwapper(config, stack.bootstrap_servers, server_url, name, deployments=decisions)
    running = asyncio.create_task(swapper.run(stop))
    try:
        await body()
        assert not running.done(), "hot swap stopped"
    finally:
        stop.set()
        await running
        await decisions.stop()


def test_a_restarted_dev_server_gets_its_deployed_weights_back_from_the_same_hot_swap(
        reconcile_setup, stack, clickhouse, caplog):
    config, name, store, home = reconcile_setup
    policy = trained_policy(config.trainer)
    server = ModelServerProcess(name, Contract.DEV, home)
    caplog.set_level(logging.INFO, logger="agentstream.hotswap")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            server.start()
            await server.ready(session)

            async def body() -> None:
                await publish(config, stack.bootstrap_servers, policy, 1, store)
                await until(lambda: served_version(session, 1), 60, "v1 loaded")
                assert_served_by(policy, await chat(session, server.url, name))

                server.kill()
                server.start()
                await server.ready(session)
                started = time.monotonic()
                assert (await holdings(session, server.url))[0] in (0, 1)  # a fresh process: the base model (v0)
                await until(lambda: served_version(session, 1), RESTORE_BOUND_S, "v1 restored after the restart")
                print(f"restored {time.monotonic() - started:.2f} s after the new server answered")
                assert_served_by(policy, await chat(session, server.url, name))
                # Replacing everyone's base weights needs the token; done with it, hot swap puts v1 back.
                assert await admin(session, server.url, "/v1/load_weights",
                                   {"path": folder_of(store, name, 1), "version": 7}, token=None) == 401
                assert await admin(session, server.url, "/v1/load_weights",
                                   {"path": folder_of(store, name, 1), "version": 7}) == 200
                await until(lambda: served_version(session, 1), RESTORE_BOUND_S, "v1 restored after load_weights")

            try:
                await run_hotswap(config, stack, clickhouse, server.url, name, body)
            finally:
                server.kill()

    async def served_version(session: aiohttp.ClientSession, version: int) -> bool:
        try:
            return (await holdings(session, server.url))[0] == version
        except aiohttp.ClientError:
            return False

    asyncio.run(scenario())
    assert "holds weights v0 where hot swap loaded v1" in caplog.text
    assert "holds weights v7 where hot swap loaded v1" in caplog.text


@pytest.mark.parametrize("contract", [Contract.VLLM, Contract.DEV], ids=str)
def test_adapters_unloaded_replaced_or_lost_in_a_restart_come_back(
        contract, reconcile_setup, stack, clickhouse, caplog, tmp_path):
    config, name, store, home = reconcile_setup
    config = replace(config, trainer=replace(config.trainer, lora=True, lora_r=4, lora_alpha=16))
    policy = trained_policy(config.trainer)
    server = ModelServerProcess(name, contract, home)
    served = adapter_name(name, 1)
    make_lora(tmp_path / "impostor")
    caplog.set_level(logging.INFO, logger="agentstream.hotswap")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            server.start()
            await server.ready(session)

            async def rooted_in_checkpoint() -> bool:
                try:
                    listed = (await holdings(session, server.url))[1]
                except aiohttp.ClientError:
                    return False
                return listed.get(served) == folder_of(store, name, 1)

            async def body() -> None:
                await publish(config, stack.bootstrap_servers, policy, 1, store)
                await until(rooted_in_checkpoint, 60, f"{served} loaded")
                assert_served_by(policy, await chat(session, server.url, served))

                assert await admin(session, server.url, "/v1/unload_lora_adapter", {"lora_name": served}, None) == 401
                assert await admin(session, server.url, "/v1/unload_lora_adapter", {"lora_name": served}) == 200
                await until(rooted_in_checkpoint, RESTORE_BOUND_S, f"{served} back after an unload")

                impostor = {"lora_name": served, "lora_path": str(tmp_path / "impostor"), "load_inplace": True}
                assert await admin(session, server.url, "/v1/load_lora_adapter", impostor, "wrong") == 401
                assert await admin(session, server.url, "/v1/load_lora_adapter", impostor) == 200
                await until(rooted_in_checkpoint, RESTORE_BOUND_S, f"{served} reloaded after an in-place replacement")
                assert_served_by(policy, await chat(session, server.url, served))

                server.kill()
                server.start()
                await server.ready(session)
                started = time.monotonic()
                await until(rooted_in_checkpoint, RESTORE_BOUND_S, f"{served} back after the restart")
                print(f"restored {time.monotonic() - started:.2f} s after the new server answered")
                assert_served_by(policy, await chat(session, server.url, served))

            try:
                await run_hotswap(config, stack, clickhouse, server.url, name, body)
            finally:
                server.kill()

    asyncio.run(scenario())
    assert f"no longer holds {served} (restarted, or unloaded behind hot swap's back)" in caplog.text
    assert f"serves {served} from {tmp_path / 'impostor'}, not from its checkpoint" in caplog.text


def test_hot_swap_sends_the_admin_token_and_a_401_is_not_taken_for_a_bad_checkpoint(reconcile_setup, stack):
    config, name, store, _ = reconcile_setup
    policy = trained_policy(config.trainer)
    wrong = replace(config, security=replace(config.security, admin_token=Secret("not-the-token")))

    async def scenario() -> None:
        runner, url = await serve_app(create_app(load_model("tiny"), served_model_names=(name,),
                                                 admin_token=KeySet(TOKEN)))
        staging = store.staging()
        manifest = write_checkpoint(store, staging, save_weights(policy, staging), model=name, version=1, step=1,
                                    format="full", offsets={}, trained_ids=[], metrics={})
        refused, accepted = HotSwapper(wrong, stack.bootstrap_servers, url, name), HotSwapper(
            config, stack.bootstrap_servers, url, name)
        try:
            with pytest.raises(AdminTokenRefused, match="401"):
                await refused.apply(manifest.checkpoint())
            refused.checkpoints[1] = manifest.checkpoint()
            assert not await refused._load_until_done(1, asyncio.Event())
            assert 1 in refused.unauthorized and 1 not in refused.refused  # tried again at the next re-check
            assert runner.app[SERVER].version == 0
            await accepted.apply(manifest.checkpoint())
            assert runner.app[SERVER].version == 1
        finally:
            await refused.close()
            await accepted.close()
            await runner.cleanup()

    asyncio.run(scenario())

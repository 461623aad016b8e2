"""Hot swap over a fleet: every server gets the deployed version, a restarted one gets it back, the proxy waits for it.

Real processes and topics: two `agentstream serve-model` processes (dev contract, full weights),
one hot swap per server in one process (what ``agentstream hotswap --server A --server B`` runs)
following the test broker with the deployments log in ClickHouse, and the proxy over both,
following the deployments topic. No gate: the first server to hold a checkpoint promotes it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import replace

import aiohttp
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from agentstream.deploy.deployments import Action, DeploymentFollower, DeploymentLog
from agentstream.infra.processes import free_port
from agentstream.pipeline.proxy.server import LLMProxy, serve_proxy
from agentstream.pipeline.proxy.upstreams import HealthSettings, holdings_rows, survey
from agentstream.serving.hotswap import HotSwapper
from agentstream.serving.hotswap_main import fleet_swappers, run_fleet
from agentstream.serving.protocol import Contract
from tests.integration.test_hotswap_reconcile import (  # noqa: F401 (reconcile_setup is a fixture)
    RESTORE_BOUND_S,
    ModelServerProcess,
    holdings,
    reconcile_setup,
    until,
)
from tests.integration.test_trainer_hotswap import trained_policy
from tests.support.deploy_scenario import publish
from tests.support.servers import HELLO
from tests.support.sinks import ListSink


def test_every_server_gets_the_version_and_a_restarted_one_gets_it_back_before_it_serves(
        reconcile_setup, stack, clickhouse):  # noqa: F811
    config, name, store, home = reconcile_setup
    policy = trained_policy(config.trainer)
    servers = [ModelServerProcess(name, Contract.DEV, home) for _ in range(2)]
    for index, server in enumerate(servers):
        server.home = home / f"server-{index}"
        server.home.mkdir()
    sink = ListSink()

    async def version_of(session: aiohttp.ClientSession, server: ModelServerProcess) -> int | None:
        try:
            return (await holdings(session, server.url))[0]
        except aiohttp.ClientError:
            return None

    async def scenario() -> dict[str, int]:
        stop = asyncio.Event()
        decisions = DeploymentLog(config, stack.bootstrap_servers, clickhouse)
        await decisions.start()
        follower = DeploymentFollower(config, stack.bootstrap_servers)
        following = asyncio.create_task(follower.run(stop))
        proxy = LLMProxy([s.url for s in servers], sink, deployments=follower,
                         health=HealthSettings(interval_s=0.25, timeout_s=1.0, eject_after=2))
        runner = await serve_proxy(proxy, "127.0.0.1", port := free_port())
        swapping = None
        try:
            async with aiohttp.ClientSession() as session:
                for server in servers:
                    server.start()
                await asyncio.gather(*(server.ready(session) for server in servers))
                swappers = fleet_swappers(config, stack.bootstrap_servers, [s.url for s in servers], name,
                                          deployments=decisions)
                swapping = asyncio.create_task(run_fleet(swappers, stop))

                async def chat() -> dict:
                    body = {"model": name, "messages": HELLO, "max_tokens": 6}
                    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as answer:
                        assert answer.status == 200, await answer.text()
                        return await answer.json()

                await publish(config, stack.bootstrap_servers, policy, 1, store)

                async def all_hold_v1() -> bool:
                    return [await version_of(session, s) for s in servers] == [1, 1]

                await until(all_hold_v1, 60, "v1 on both servers")
                routing = await until(lambda: _routed(follower, name), 30, "the proxy to route to v1")
                assert routing.stable_version == 1
                await asyncio.gather(*(chat() for _ in range(6)))

                restarted = servers[1]
                restarted.kill()
                restarted.start()
                await restarted.ready(session)
                started, meanwhile = time.monotonic(), 0
                while (await version_of(session, restarted)) != 1:  # calls meanwhile go only where v1 is
                    await chat()
                    meanwhile += 1
                    assert time.monotonic() - started < RESTORE_BOUND_S, "v1 was not restored on the restarted server"
                print(f"v1 restored {time.monotonic() - started:.2f} s after the restarted server answered; "
                      f"{meanwhile} calls meanwhile")
                await until(lambda: _healthy_with(proxy, restarted.url, 1), 10, "the proxy to see v1 there")
                view = holdings_rows(await survey([s.url for s in servers]), [routing], name)
                assert [row[1:] for row in view] == [["yes", 1, name, ""]] * 2, view
                listed = await asyncio.to_thread(
                    subprocess.run, [sys.executable, "-m", "agentstream", "deployments", "--model", name,
                                     "--server", servers[0].url, "--server", servers[1].url],
                    env=_env(config, stack), capture_output=True, text=True, timeout=120)
                assert listed.returncode == 0, listed.stderr
                assert "model servers:" in listed.stdout and all(s.url in listed.stdout for s in servers)
                before = {r.url: r.served for r in proxy.pool.replicas}
                await asyncio.gather(*(chat() for _ in range(6)))
                return {r.url: r.served - before[r.url] for r in proxy.pool.replicas}
        finally:
            stop.set()
            if swapping is not None:
                await swapping
            await runner.cleanup()
            await following
            await decisions.stop()
            for server in servers:
                server.kill()

    after_restore = asyncio.run(scenario())
    llm = sink.of("LLM")
    assert llm and all(span["policy_version"] == 1 for span in llm), \
        [(s["policy_version"], s["attributes"].get("agentstream.upstream")) for s in llm]
    assert {s["attributes"]["agentstream.upstream"] for s in llm} == {s.url for s in servers}
    assert after_restore[servers[1].url] > 0, "the restored server takes requests again"
    rows = clickhouse.query("SELECT version, action, decided_by FROM deployments FINAL WHERE model = {m:String}",
                            parameters={"m": name}).result_rows
    assert rows == [(1, str(Action.PROMOTED), "hotswap")], "one promotion for the fleet, not one per server"


def test_a_hot_swap_that_fails_stops_the_fleet_and_its_error_comes_out(reconcile_setup, stack, clickhouse):  # noqa: F811
    """One server's hot swap cannot record its promotion (no such database); it and the other, waiting for a server
    that never answers, stop, and its error comes out: the process does not run on with one server unattended."""
    config, name, store, home = reconcile_setup
    server = ModelServerProcess(name, Contract.DEV, home)
    elsewhere = replace(config, clickhouse=replace(config.clickhouse, database="no_such_database"))

    async def scenario() -> None:
        nowhere = DeploymentLog(elsewhere, stack.bootstrap_servers, clickhouse)
        await nowhere.start()
        try:
            async with aiohttp.ClientSession() as session:
                server.start()
                await server.ready(session)
            await publish(config, stack.bootstrap_servers, trained_policy(config.trainer), 1, store)
            swappers = [HotSwapper(config, stack.bootstrap_servers, f"http://127.0.0.1:{free_port()}", name),
                        HotSwapper(config, stack.bootstrap_servers, server.url, name, deployments=nowhere)]
            await asyncio.wait_for(run_fleet(swappers, asyncio.Event()), 60)
        finally:
            await nowhere.stop()
            server.kill()

    with pytest.raises(DatabaseError, match="no_such_database"):
        asyncio.run(scenario())


async def _routed(follower: DeploymentFollower, name: str):
    routing = follower.routing(name)
    return routing if routing is not None and routing.stable_version == 1 else None


async def _healthy_with(proxy: LLMProxy, url: str, version: int) -> bool:
    return any(r.url == url and r.healthy and r.version == version for r in proxy.pool.replicas)


def _env(config, stack) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
    env.update(KAFKA_BOOTSTRAP_SERVERS=stack.bootstrap_servers, CLICKHOUSE_URL=stack.clickhouse_url,
               CLICKHOUSE_DATABASE=config.clickhouse.database, AGENTSTREAM_TOPIC_PREFIX=config.topics.prefix)
    return env

"""The proxy in front of a fleet: two `agentstream serve-model` processes, the official openai client, a SIGKILL.

Everything is real: each model server is its own process (killed with SIGKILL and started again
on its port), the proxy runs in this process with its health checks on, and the client is the
openai SDK with its own retries off, so every failure the proxy lets through is seen here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import aiohttp
import openai
import pytest

from agentstream.deploy.deployments import Routing
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.proxy.upstreams import HealthSettings, UpstreamPool
from agentstream.serving.protocol import Contract
from tests.integration.test_hotswap_reconcile import ModelServerProcess, admin
from tests.support.http_thread import ServerThread
from tests.support.servers import HELLO, make_lora
from tests.support.sinks import ListSink

HEALTH = HealthSettings(interval_s=0.25, timeout_s=1.0, eject_after=2)


@dataclass
class Fleet:
    servers: list[ModelServerProcess]
    adapter: str  # a LoRA adapter's folder, loaded on the first server only


async def start(servers: list[ModelServerProcess]) -> None:
    for server in servers:
        server.start()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(server.ready(session) for server in servers))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    home = tmp_path_factory.mktemp("fleet")
    servers = [ModelServerProcess("tiny", Contract.DEV, home) for _ in range(2)]
    for index, server in enumerate(servers):  # each its own logs
        server.home = home / f"server-{index}"
        server.home.mkdir()
    adapter = home / "adapter"
    make_lora(adapter)
    try:
        asyncio.run(start(servers))
        yield Fleet(servers, str(adapter))
    finally:
        for server in servers:
            server.kill()


class Proxy:
    """The proxy over some model servers, served from a thread, and its spans."""

    def __init__(self, urls: list[str], deployments=None, health: HealthSettings = HEALTH) -> None:
        self.sink = ListSink()
        self.proxy = LLMProxy(urls, self.sink, deployments=deployments, health=health)
        self.thread = ServerThread(self.proxy.app)
        self.url = self.thread.url

    @property
    def pool(self) -> UpstreamPool:
        return self.proxy.pool

    def client(self, **options) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **options)

    def served_by(self) -> list[str]:
        return [span["attributes"].get("agentstream.upstream") for span in self.sink.of("LLM")]

    def stop(self) -> None:
        self.thread.stop()


class Table:
    """A routing table with one model's routing, as the deployments follower holds it."""

    def __init__(self, routing: Routing) -> None:
        self.routes = {routing.model: routing}

    def routing(self, model: str) -> Routing | None:
        return self.routes.get(model)

    async def current(self, model: str) -> None:
        """Always current: nothing to read."""


async def chat(client: openai.AsyncOpenAI, model: str = "tiny", max_tokens: int = 8, **options):
    return await client.chat.completions.create(model=model, messages=HELLO, max_tokens=max_tokens, **options)


def until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def test_a_version_goes_only_to_the_replicas_that_hold_it(fleet):
    holder, other = fleet.servers
    table = Table(Routing("tiny", stable_version=1, candidate_version=3))
    proxy = Proxy([holder.url, other.url], deployments=table)
    try:
        async def go():
            async with aiohttp.ClientSession() as session:
                assert await admin(session, holder.url, "/v1/load_lora_adapter",
                                   {"lora_name": "tiny@v1", "lora_path": fleet.adapter, "version": 1}) == 200
            client = proxy.client()
            # stable v1, loaded after the proxy's last listing: looked up again at once, then only on its holder
            await asyncio.gather(*(chat(client) for _ in range(6)))
            await asyncio.gather(*(chat(client, "tiny@v1") for _ in range(4)))
            base = await asyncio.gather(*(chat(client, "tiny@v0") for _ in range(6)))  # both hold the base model
            with pytest.raises(openai.NotFoundError, match="held by no model server"):
                await chat(client, "tiny@v3")  # a candidate the table allows a pin of, on no replica
            table.routes["tiny"] = Routing("tiny", stable_version=2)  # deployed, on no replica yet
            with pytest.raises(openai.APIStatusError) as refused:
                await chat(client)
            return base, refused.value

        base, refused = asyncio.run(go())
        served = proxy.served_by()
        assert served[:10] == [holder.url] * 10, "v1's requests reach only the replica that holds v1"
        assert set(served[10:16]) == {holder.url, other.url}, "the base model is on both"
        assert all(response.choices[0].message.content is not None for response in base)
        assert refused.status_code == 503 and refused.response.headers["Retry-After"] == "1"
        assert "no model server holds `tiny@v2`" in refused.message
    finally:
        proxy.stop()


def test_a_call_for_a_deployed_version_no_replica_holds_yet_waits_for_hot_swap_to_load_it(fleet):
    """A version just promoted on a replica that then died: the call is served once another loads it, not refused.

    Hot swap loads the newest version, so the call is routed again while it waits: here v6 is promoted meanwhile
    and only v6 is ever loaded."""
    holder = fleet.servers[1]
    table = Table(Routing("tiny", stable_version=5))
    proxy = Proxy([s.url for s in fleet.servers], deployments=table)
    try:
        async def go():
            call = asyncio.create_task(chat(proxy.client()))
            await asyncio.sleep(1.0)
            assert not call.done(), "it waits for a replica holding v5"
            table.routes["tiny"] = Routing("tiny", stable_version=6)
            async with aiohttp.ClientSession() as session:
                assert await admin(session, holder.url, "/v1/load_lora_adapter",
                                   {"lora_name": "tiny@v6", "lora_path": fleet.adapter, "version": 6}) == 200
                try:
                    return await call
                finally:
                    await admin(session, holder.url, "/v1/unload_lora_adapter", {"lora_name": "tiny@v6"})

        response = asyncio.run(go())
        assert response.choices[0].message.content is not None
        assert proxy.served_by() == [holder.url]
        assert [span["policy_version"] for span in proxy.sink.of("LLM")] == [6]
    finally:
        proxy.stop()


def test_load_spreads_survives_a_sigkill_and_the_replica_returns(fleet):
    first, second = fleet.servers
    proxy = Proxy([first.url, second.url])
    try:
        async def spread():
            client = proxy.client()
            return await asyncio.gather(*(chat(client) for _ in range(8)))

        asyncio.run(spread())
        assert set(proxy.served_by()) == {first.url, second.url}, "concurrent requests use both replicas"
        assert {r.url: r.served for r in proxy.pool.replicas}[second.url] >= 2

        killed = threading.Event()

        def kill_when_busy() -> None:
            until(lambda: proxy.pool.replicas[1].outstanding > 0, 30, "a request in flight on the second replica")
            second.kill()
            killed.set()

        killer = threading.Thread(target=kill_when_busy)
        killer.start()

        async def load() -> tuple[int, int]:
            client = proxy.client()
            done = after = 0

            async def worker() -> None:
                nonlocal done, after
                while after < 12:
                    response = await chat(client, max_tokens=24)  # any failure here fails the test
                    assert response.choices[0].message.content is not None
                    done += 1
                    after += killed.is_set()

            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(4))), 120)
            return done, after

        done, after = asyncio.run(load())
        killer.join(timeout=5)
        assert killed.is_set() and after >= 12
        assert proxy.pool.retries >= 1, "the request in flight on the killed replica was retried on the other"
        retried = [span for span in proxy.sink.of("LLM") if span["attributes"].get("agentstream.upstream.retried")]
        assert len(retried) == proxy.pool.retries and all(s["status"] == "OK" for s in retried)
        until(lambda: not proxy.pool.replicas[1].healthy, 10, "the killed replica to be ejected")

        before = proxy.pool.replicas[1].served
        asyncio.run(start([second]))
        until(lambda: proxy.pool.replicas[1].healthy, 10, "the restarted replica to pass a health check")

        async def again():
            client = proxy.client()
            await asyncio.gather(*(chat(client) for _ in range(6)))
            finished = []  # a stream after the return, relayed to its end as before (the tiny model's sampled
            async for chunk in await chat(client, stream=True):  # bytes may decode to no text, so none is asked)
                finished += [choice.finish_reason for choice in chunk.choices if choice.finish_reason]
            return finished

        assert asyncio.run(again()) in (["length"], ["stop"])
        assert proxy.pool.replicas[1].served > before, "the returned replica takes requests again"
        print(f"fleet: {done} requests, {proxy.pool.retries} retried on the other replica after the SIGKILL")
    finally:
        proxy.stop()


def test_a_request_refused_by_a_dead_replica_is_retried_stream_or_not(fleet):
    from agentstream.infra.processes import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    alive = fleet.servers[0].url
    proxy = Proxy([dead, alive], health=HealthSettings(interval_s=30, timeout_s=1.0, eject_after=100))
    try:
        async def go():
            client = proxy.client()
            texts = []
            for _ in range(4):
                texts.append((await chat(client)).choices[0].message.content)
                text = ""
                async for chunk in await chat(client, stream=True):
                    text += "".join(choice.delta.content or "" for choice in chunk.choices)
                texts.append(text)
            return texts

        texts = asyncio.run(go())
        assert all(text is not None for text in texts)
        assert proxy.pool.retries >= 2, "ties alternate, so the dead replica was tried first at least twice"
        assert set(proxy.served_by()) == {alive}
    finally:
        proxy.stop()

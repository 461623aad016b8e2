"""The streams worker (streams/app.py): its ingestion queue holds records until stored and makes the agent wait only
on queued bytes; its state lives under the stack home."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentstream.infra.config import load_config
from agentstream.streams.app import Ingestion
from agentstream.streams.records import RawRecord


class Store:
    """A processor whose inserts wait until ``open`` is set (ClickHouse slow or down), recording what they stored."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.stored: list[Any] = []

    async def ingest(self, batches: list[Any]) -> None:
        await self.open.wait()
        self.stored.extend(batches)


class Holds:
    def __init__(self) -> None:
        self.held: set[int] = set()

    def hold(self, record: RawRecord) -> None:
        self.held.add(record.offset)

    def release(self, record: RawRecord) -> None:
        self.held.remove(record.offset)


def records(first: int, count: int, size: int) -> list[RawRecord]:
    return [RawRecord("spans", 0, first + n, b"k", b"x" * size) for n in range(count)]


def test_the_agent_waits_only_once_the_queued_bytes_reach_the_bound() -> None:
    async def scenario() -> None:
        store, holds = Store(), Holds()
        ingestion = Ingestion(store, holds, interval_s=0.01, max_bytes=1000)  # type: ignore[arg-type]
        runner = asyncio.create_task(ingestion.run())
        for batch in range(9):  # 900 bytes: many more batches than a count-bounded queue of 4 let through
            await asyncio.wait_for(ingestion.put(records(batch * 10, 10, 10), f"b{batch}"), 1)
        await asyncio.wait_for(ingestion.put(records(90, 10, 10), "b9"), 1)  # 1000 bytes queued now
        blocked = asyncio.create_task(ingestion.put(records(100, 1, 10), "b10"))
        await asyncio.sleep(0.1)
        assert not blocked.done() and len(holds.held) == 100 and store.stored == []
        store.open.set()  # ClickHouse is back: what was queued is stored and released, and the agent goes on
        await asyncio.wait_for(blocked, 1)
        await asyncio.sleep(0.1)
        assert store.stored == [f"b{n}" for n in range(11)] and holds.held == set() and ingestion.queued_bytes == 0
        runner.cancel()

    asyncio.run(scenario())


def test_a_batch_published_longer_ago_than_the_interval_is_stored_at_once_a_fresh_one_waits_the_interval() -> None:
    async def scenario() -> None:
        store, holds = Store(), Holds()
        store.open.set()
        ingestion = Ingestion(store, holds, interval_s=30)  # type: ignore[arg-type]
        runner = asyncio.create_task(ingestion.run())
        await ingestion.put(records(0, 2, 10), "backlog", published_at=time.time() - 60)  # read after a restart
        await asyncio.sleep(0.2)
        assert store.stored == ["backlog"] and holds.held == set()
        await ingestion.put(records(2, 2, 10), "fresh", published_at=time.time())
        await ingestion.put(records(4, 2, 10), "from-a-fast-clock", published_at=time.time() + 60)
        await asyncio.sleep(0.2)
        assert store.stored == ["backlog"] and holds.held == {2, 3, 4, 5}  # both wait out the 30 s interval
        runner.cancel()

    asyncio.run(scenario())


def test_the_streams_worker_keeps_its_state_under_the_stack_home(tmp_path, monkeypatch):
    from agentstream.streams.app import create_app

    monkeypatch.chdir(tmp_path)
    config = load_config(environ={"AGENTSTREAM_HOME": str(tmp_path / "home")})
    app = create_app(config, "127.0.0.1:1", "http://127.0.0.1:2")
    assert app.conf.datadir.is_relative_to(tmp_path / "home"), "not faust's default, the current directory"

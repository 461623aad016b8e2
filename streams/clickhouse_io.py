"""ClickHouse I/O for the stream processors: retried through outages, never dropping data.

A connection failure or a transient server error is retried with exponential backoff for as
long as it takes (the processor holds its offsets meanwhile, which is the backpressure); a
clear warning is logged once per outage. An error that says the data itself is wrong raises
:class:`RejectedData`, so the caller can find and dead-letter the bad record.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from clickhouse_connect.driver.client import Client

from agentstream.infra.clickhouse import ClickHouseError, UnsupportedClickHouse, connect, server_message
from agentstream.infra.config import ClickHouseConfig
from agentstream.schemas.errors import AgentstreamError

log = logging.getLogger("agentstream.streams.clickhouse")

T = TypeVar("T")
EXCEPTION_CODE = re.compile(r"Code:\s*(\d+)")
# Server-side conditions that pass: overload, memory, timeouts, read-only replicas, shutdown, a full disk
# (243 NOT_ENOUGH_SPACE: the data is fine and goes in once space comes back).
TRANSIENT_CODES = {3, 159, 160, 202, 209, 210, 241, 242, 243, 252, 319, 394, 425, 999, 1002}
DISK_TROUBLE = ("No space left on device", "Read-only file system", "Disk quota exceeded")
"""Whatever the code that carries them (a failed write is 75, a filesystem error 1001), these are the disk's."""


class RejectedData(AgentstreamError):
    """ClickHouse refused the data itself (it cannot parse or convert it); retrying cannot help."""


class Warehouse:
    """A clickhouse-connect client used from an event loop: calls run in a worker thread, with retries."""

    def __init__(self, config: ClickHouseConfig, url: str, *, retry_max_s: float = 10.0) -> None:
        self.config = config
        self.url = url
        self.database = config.database
        self.retry_max_s = retry_max_s
        self._client: Client | None = None
        self.outages = 0
        self.seconds: dict[str, list[float]] = {}  # time spent per kind of call: [calls, seconds]

    def _connected(self) -> Client:
        if self._client is None:
            self._client = connect(self.config, self.url, database=self.database)
        return self._client

    async def call(self, what: str, work: Callable[[Any], T]) -> T:
        """Run ``work(client)`` in a thread until it succeeds; RejectedData is raised, outages are waited out."""
        delay, warned = 0.1, False
        while True:
            try:
                started = time.perf_counter()
                result = await asyncio.to_thread(lambda: work(self._connected()))
                spent = self.seconds.setdefault(what, [0, 0.0])
                spent[0] += 1
                spent[1] += time.perf_counter() - started
                if warned:
                    log.warning("ClickHouse at %s is back; %s went through", self.url, what)
                return result
            except UnsupportedClickHouse:
                raise
            except ClickHouseError as error:
                reason = str(error)
            except Exception as error:
                reason = server_message(error)
                code = EXCEPTION_CODE.search(reason)
                if code and int(code.group(1)) not in TRANSIENT_CODES and not any(
                        trouble in reason for trouble in DISK_TROUBLE):
                    raise RejectedData(f"{what}: {reason.splitlines()[0]}") from None
                self._client = None
            if not warned:
                self.outages += 1
                log.warning("ClickHouse at %s unavailable during %s (%s): holding offsets and retrying",
                            self.url, what, reason.splitlines()[0] if reason else "no answer")
                warned = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.retry_max_s)

    async def insert_container(self, table: str, container: bytes) -> None:
        """Insert an Avro object container file (ClickHouse decodes it)."""
        settings = {"input_format_avro_allow_missing_fields": 1}
        await self.call(f"insert into {table}", lambda client: client.raw_insert(
            table, None, container, settings=settings, fmt="Avro"))

    async def insert_rows(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        if rows:
            await self.call(f"insert into {table}",
                            lambda client: client.insert(table, rows, column_names=list(columns)))

    async def query(self, sql: str, parameters: dict[str, Any] | None = None):
        return await self.call("query", lambda client: client.query(sql, parameters=parameters))

    async def query_arrow(self, sql: str, parameters: dict[str, Any] | None = None):
        return await self.call("query", lambda client: client.query_arrow(sql, parameters=parameters))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

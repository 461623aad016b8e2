"""Read-only queries to ClickHouse over its HTTP interface, from the dashboard's event loop.

Every request carries ``readonly=2``: the server refuses any statement that writes or changes
schema (settings may still be passed, which ``readonly=1`` would refuse). The same holds for
the embedded chdb server (stack/chserver.py), which runs such requests on its read-only
connection. Parameters travel as ``param_<name>`` URL parameters, never formatted into SQL.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp

from agentstream.infra.config import ClickHouseConfig
from agentstream.schemas.errors import AgentstreamError

READ_ONLY_SETTINGS = {
    "readonly": "2",
    "default_format": "JSONCompact",
    "output_format_json_quote_64bit_integers": "0",
    "output_format_json_quote_denormals": "0",
    "date_time_output_format": "iso",
}


class WarehouseError(AgentstreamError, RuntimeError):
    """ClickHouse refused a dashboard query or could not be reached; the message is ClickHouse's own."""


@dataclass(frozen=True)
class QueryResult:
    """Columns (name, type), rows, and how long the query took end to end."""

    columns: list[tuple[str, str]]
    rows: list[list[Any]]
    elapsed_ms: float


def _parameter(value: Any) -> str:
    """A parameter as ClickHouse's HTTP interface expects it (text; arrays and maps as literals)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and math.isinf(value):
        return "-1e308" if value < 0 else "1e308"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    return str(value)


class Warehouse:
    """An aiohttp session to one ClickHouse database, for read-only queries."""

    def __init__(self, config: ClickHouseConfig, url: str, database: str, *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/") + "/"
        self.database = database
        self._config = config
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> Warehouse:
        headers = {}
        if self._config.username:  # ClickHouse's own HTTP credential headers
            headers["X-ClickHouse-User"] = self._config.username
            headers["X-ClickHouse-Key"] = self._config.password.reveal() if self._config.password else ""
        connector = aiohttp.TCPConnector(ssl=self._config.verify_tls)  # False: skip certificate checks
        self._session = aiohttp.ClientSession(timeout=self._timeout, headers=headers, connector=connector)
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        """Run one SELECT read-only; raises WarehouseError with ClickHouse's message when it fails."""
        if self._session is None:
            raise WarehouseError("the warehouse session is not started")
        params = {**READ_ONLY_SETTINGS, "database": self.database}
        params.update({f"param_{name}": _parameter(value) for name, value in (parameters or {}).items()})
        started = time.perf_counter()
        try:
            async with self._session.post(self.url, params=params, data=sql.encode()) as response:
                body = await response.read()
                if response.status != 200:
                    text = body.decode(errors="replace").strip()
                    raise WarehouseError(text.splitlines()[0] if text else f"HTTP {response.status}")
        except aiohttp.ClientError as error:
            raise WarehouseError(f"cannot reach ClickHouse at {self.url}: {error}") from None
        try:
            decoded = json.loads(body)
        except ValueError as error:
            raise WarehouseError(f"ClickHouse answered something other than JSON: {error}") from None
        columns = [(column["name"], column["type"]) for column in decoded.get("meta", [])]
        return QueryResult(columns, decoded.get("data", []), (time.perf_counter() - started) * 1000)

"""The ClickHouse client's version check refuses servers that are too old; a refusal is told from an outage."""

from __future__ import annotations

import pytest
from aiohttp import web

from agentstream.infra.clickhouse import (
    ClickHouseError,
    ClickHouseUnreachable,
    UnsupportedClickHouse,
    check_version,
    connect,
)
from agentstream.infra.config import ClickHouseConfig
from agentstream.infra.processes import free_port
from tests.support.http_thread import ServerThread


def test_version_check_refuses_old_servers():
    with pytest.raises(UnsupportedClickHouse, match=r"18\.16\.1 .* too old"):
        check_version("18.16.1", "http://old:8123")
    check_version("26.9.2.1", "http://new:8123")


def test_a_server_that_refuses_is_a_permanent_error_and_one_that_is_not_there_a_retriable_one():
    async def unknown_database(request: web.Request) -> web.Response:
        return web.Response(status=404, headers={"X-ClickHouse-Exception-Code": "81"},
                            text="Code: 81. DB::Exception: Database nowhere does not exist. (UNKNOWN_DATABASE)")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", unknown_database)
    server = ServerThread(app)
    try:
        with pytest.raises(ClickHouseError, match="refused the connection: Code: 81") as refused:
            connect(ClickHouseConfig(), server.url, database="nowhere", timeout_s=5)
    finally:
        server.stop()
    assert type(refused.value) is ClickHouseError and refused.value.retriable is False
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ClickHouseUnreachable, match=f"cannot reach ClickHouse at {url}") as away:
        connect(ClickHouseConfig(), url, timeout_s=5)
    assert away.value.retriable is True

"""The ClickHouse client's version check refuses servers that are too old."""

from __future__ import annotations

import pytest

from agentstream.infra.clickhouse import UnsupportedClickHouse, check_version


def test_version_check_refuses_old_servers():
    with pytest.raises(UnsupportedClickHouse, match=r"18\.16\.1 .* too old"):
        check_version("18.16.1", "http://old:8123")
    check_version("26.9.2.1", "http://new:8123")

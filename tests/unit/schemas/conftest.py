"""Fixtures shared by the schema tests."""

from __future__ import annotations

import pytest

from agentstream.schemas import AvroCodec


@pytest.fixture(scope="module")
def codec() -> AvroCodec:
    return AvroCodec()

"""Fixtures shared by the schema tests."""

from __future__ import annotations

import pytest

from schemas import AvroCodec


@pytest.fixture(scope="module")
def codec() -> AvroCodec:
    return AvroCodec()

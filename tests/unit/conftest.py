"""Fixtures shared by the unit tests of several packages."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny():
    """The tiny test model (models.load_model("tiny")), loaded once per test module."""
    from agentstream.models import load_model

    return load_model("tiny")

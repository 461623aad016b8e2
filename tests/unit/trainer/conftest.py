"""Fixtures shared by the trainer's unit tests."""

from __future__ import annotations

import pytest

from agentstream.infra.config import TrainerConfig


@pytest.fixture(scope="module")
def tiny_config() -> TrainerConfig:
    return TrainerConfig(model="tiny", lr=1e-3, threads=1, device="cpu", grad_clip=1e9)

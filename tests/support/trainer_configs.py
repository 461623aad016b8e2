"""The ``[trainer]`` section the crash and restart tests give a tiny-model ``train-worker`` process."""

from __future__ import annotations

from pathlib import Path


def tiny_trainer_toml(model: str, checkpoints: Path | str, *, checkpoint_every_steps: int = 2,
                      **extra: int) -> str:
    """A tiny CPU trainer that steps on every 4 transitions and never drops one as stale; ``extra`` adds keys."""
    lines = [f'model_name = "{model}"', f"checkpoint_every_steps = {checkpoint_every_steps}",
             f'checkpoint_dir = "{checkpoints}"', *(f"{key} = {value}" for key, value in extra.items())]
    return "\n".join(["[trainer]", 'model = "tiny"', 'device = "cpu"', "threads = 1", "lr = 0.001",
                      "batch_transitions = 4", "batch_tokens = 0", "batch_wait_s = 60", "max_policy_lag = 1000",
                      "session_timeout_s = 3", *lines]) + "\n"

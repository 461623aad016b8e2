"""The ``[trainer]`` section the crash and restart tests give a tiny-model ``train-worker`` process."""

from __future__ import annotations

from pathlib import Path


def tiny_trainer_toml(model: str, checkpoints: Path | str, *, checkpoint_every_steps: int = 2,
                      **extra: int | float) -> str:
    """A tiny CPU trainer that steps on every 4 transitions and never drops one as stale; ``extra`` adds keys or
    replaces the defaults (``batch_wait_s = 2`` for a test that needs its last, partial batch trained)."""
    keys: dict[str, str] = {"model": '"tiny"', "device": '"cpu"', "threads": "1", "lr": "0.001",
                            "batch_transitions": "4", "batch_tokens": "0", "batch_wait_s": "60",
                            "max_policy_lag": "1000", "session_timeout_s": "3", "model_name": f'"{model}"',
                            "checkpoint_every_steps": str(checkpoint_every_steps),
                            "checkpoint_dir": f'"{checkpoints}"'}
    keys.update({key: str(value) for key, value in extra.items()})
    return "\n".join(["[trainer]", *(f"{key} = {value}" for key, value in keys.items())]) + "\n"

"""Confidence intervals for success rates measured on a few dozen tasks (the benches report them beside accuracies)."""

from __future__ import annotations

import math


def wilson_interval(accuracy: float, tasks: int, z: float = 1.96) -> list[float]:
    """The 95% Wilson score interval of a success rate measured on ``tasks`` tasks."""
    centre = (accuracy + z * z / (2 * tasks)) / (1 + z * z / tasks)
    half = z * math.sqrt(accuracy * (1 - accuracy) / tasks + z * z / (4 * tasks * tasks)) / (1 + z * z / tasks)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]

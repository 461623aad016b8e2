"""Training samples for trainer tests."""

from __future__ import annotations

from models import teacher_forced_logprobs
from trainer.batching import Sample


def generated(policy, count: int, advantage: float) -> list[Sample]:
    """Samples whose behaviour logprobs are the policy's own teacher-forced logprobs (ratio exactly 1)."""
    out = []
    for index in range(count):
        prompt, response = [5 + index, 6, 7, 8], [40 + index, 41, 42 + index]
        logprobs = teacher_forced_logprobs(policy.model, prompt, response, 1.0)
        out.append(Sample(f"s{index}", "r", 0, prompt, response, logprobs, 1.0, advantage))
    return out

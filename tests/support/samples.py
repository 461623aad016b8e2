"""Training samples for trainer tests: a policy's own generations, and a two-call trajectory-level record."""

from __future__ import annotations

from agentstream.models import teacher_forced_logprobs
from agentstream.trainer.batching import Sample

PROMPT = [5, 6, 7, 8, 9, 10]
CALL_1, TOOL, CALL_2 = [40, 41, 42, 43], [90, 91, 92], [44, 45, 46]
MASK = (True,) * len(CALL_1) + (False,) * len(TOOL) + (True,) * len(CALL_2)


def record(**overrides) -> dict:
    """A decoded Transition record of a two-call trajectory sample (prompt, call 1, tool result, call 2)."""
    values = {"transition_id": "t", "rollout_id": "r", "policy_version": 0, "prompt_token_ids": PROMPT,
              "response_token_ids": CALL_1 + TOOL + CALL_2, "behaviour_logprobs": [-1.0] * 4 + [0.0] * 3 + [-2.0] * 3,
              "loss_mask": list(MASK), "merged_calls": 2, "split_at_break": True, "reward": 1.0, "advantage": 0.5}
    return {**values, **overrides}


def generated(policy, count: int, advantage: float) -> list[Sample]:
    """Samples whose behaviour logprobs are the policy's own teacher-forced logprobs (ratio exactly 1)."""
    out = []
    for index in range(count):
        prompt, response = [5 + index, 6, 7, 8], [40 + index, 41, 42 + index]
        logprobs = teacher_forced_logprobs(policy.model, prompt, response, 1.0)
        out.append(Sample(f"s{index}", "r", 0, prompt, response, logprobs, 1.0, advantage))
    return out

"""Span records for tests of the wire format: random spans with every optional field, in the shapes agents send."""

from __future__ import annotations

import random


def random_span(rng: random.Random, index: int) -> dict:
    llm = index % 3 != 2
    span = {"span_id": f"s{index}", "rollout_id": "r", "attempt_id": rng.choice(["a1", "a2"]), "name": "chat é",
            "kind": "LLM" if llm else "REWARD", "start_time_us": rng.randrange(1 << 52),
            "end_time_us": rng.randrange(1 << 52), "status": rng.choice(["OK", "ERROR", "UNSET"]),
            "attributes": {f"k{i}": "v" * rng.randrange(200) for i in range(rng.randrange(4))},
            "parent_id": rng.choice([None, "root"]), "agent_name": rng.choice([None, "agent"]),
            "group_id": rng.choice([None, "g"]), "model": "m" if llm else None,
            "policy_version": rng.choice([None, rng.randrange(1 << 40)]),
            "reward": None if llm else rng.uniform(-1, 1),
            "reward_dimensions": None if llm else {"format": 0.5}}
    if llm:
        size = rng.choice([0, 1, 63, 64, 300])  # counts around the one-byte varint limit
        span["prompt_token_ids"] = [rng.randrange(-(1 << 31), 1 << 31) for _ in range(size)]
        span["response_token_ids"] = [rng.randrange(1 << 17) for _ in range(rng.randrange(1, 80))]
        span["response_logprobs"] = [-rng.random() for _ in span["response_token_ids"]]
    return span

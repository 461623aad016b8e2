"""Avro test data shared by the schema tests: a sample of every record, spans, the pinned schema ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentstream.schemas import (
    ANNOUNCEMENT,
    CHECKPOINT,
    DEAD_LETTER,
    DEPLOYMENT,
    ROLLOUT_EVENT,
    ROLLOUT_RESULT,
    SPAN,
    SPAN_BATCH,
    TASK,
    TRANSITION,
    TRANSITION_BATCH,
)

ROOT = Path(__file__).resolve().parents[2]
AVRO_DIR = ROOT / "schemas" / "avro"


# Changing a current schema changes its id. Before you do, copy the old file to
# schemas/avro/history/ (see the README there) so records already on Kafka stay readable;
# then update the id here.
PINNED_IDS = {
    ANNOUNCEMENT: 1743986076,
    CHECKPOINT: 1836988109,
    DEAD_LETTER: 208212813,
    DEPLOYMENT: 1973247138,
    ROLLOUT_EVENT: 1187672618,
    ROLLOUT_RESULT: 1881895367,
    SPAN: 1310064008,
    SPAN_BATCH: 692827969,
    TASK: 87156492,
    TRANSITION: 1993928380,
    TRANSITION_BATCH: 2086229143,
}


T0 = 1_732_200_000_000_000  # 2024-11-21T14:40:00Z in microseconds


def llm_span(**overrides: Any) -> dict[str, Any]:
    """A complete LLM span, every field given; logprobs are exact in float32 so they round-trip equal."""
    span = {
        "span_id": "3f2a9c1e8b7d4a60",
        "rollout_id": "ro-7f3e2d1c",
        "attempt_id": "at-1",
        "parent_id": "1122334455667788",
        "name": "chat Qwen2.5-0.5B-Instruct",
        "kind": "LLM",
        "start_time_us": T0,
        "end_time_us": T0 + 250_000,
        "status": "OK",
        "status_message": None,
        "agent_name": "math-agent",
        "task_id": "gsm8k-00042",
        "group_id": "g-42",
        "model": "Qwen2.5-0.5B-Instruct",
        "attributes": {"gen_ai.system": "openai", "gen_ai.request.model": "Qwen2.5-0.5B-Instruct"},
        "prompt_token_ids": [151644, 8948, 198, 0],
        "response_token_ids": [785, 4226, 374],
        "response_logprobs": [-0.5, -1.25, -0.0625],
        "reward": None,
        "reward_dimensions": None,
        "policy_version": 7,
    }
    return {**span, **overrides}


def reward_span() -> dict[str, Any]:
    return llm_span(
        span_id="aa00",
        name="reward",
        kind="REWARD",
        status="UNSET",
        model=None,
        attributes={},
        prompt_token_ids=None,
        response_token_ids=None,
        response_logprobs=None,
        reward=0.75,
        reward_dimensions={"correctness": 1.0, "format": 0.5},
        policy_version=None,
    )


SAMPLES: dict[str, dict[str, Any]] = {
    SPAN: llm_span(),
    SPAN_BATCH: {"spans": [llm_span(), reward_span()]},
    TASK: {
        "task_id": "gsm8k-00042",
        "rollout_id": "ro-7f3e2d1c",
        "group_id": "g-42",
        "agent_name": "math-agent",
        "input": json.dumps({"question": "2+2?"}),
        "attempt": 2,
        "max_attempts": 3,
        "timeout_s": 120.0,
        "enqueued_at_us": T0,
        "metadata": {"dataset": "gsm8k", "split": "train"},
    },
    ROLLOUT_EVENT: {
        "rollout_id": "ro-7f3e2d1c",
        "attempt_id": "at-1",
        "event": "FAILED",
        "at_us": T0,
        "worker_id": "runner-3",
        "error": "ValueError: boom",
        "task_id": "gsm8k-00042",
        "agent_name": "math-agent",
    },
    TRANSITION: {
        "transition_id": "tr-1",
        "rollout_id": "ro-7f3e2d1c",
        "span_id": "3f2a9c1e8b7d4a60",
        "agent_name": "math-agent",
        "model": "Qwen2.5-0.5B-Instruct",
        "policy_version": 7,
        "step_index": 0,
        "prompt_token_ids": [151644, 8948],
        "response_token_ids": [785, 4226],
        "behaviour_logprobs": [-0.5, -2.0],
        "loss_mask": [],
        "merged_calls": 1,
        "split_at_break": False,
        "reward": 1.0,
        "return_value": 0.9,
        "advantage": -0.125,
        "group_id": None,
        "created_at_us": T0,
    },
    TRANSITION_BATCH: {
        "transitions": [{
            "transition_id": "tr-2", "rollout_id": "ro-1", "span_id": "sp-1", "agent_name": "math-agent",
            "model": "m", "policy_version": 1, "step_index": 0, "prompt_token_ids": [1], "response_token_ids": [2],
            "behaviour_logprobs": [-0.25], "loss_mask": [True], "merged_calls": 1, "split_at_break": False,
            "reward": 1.0, "return_value": 1.0, "advantage": 0.5, "group_id": "g",
            "created_at_us": T0,
        }],
    },
    CHECKPOINT: {
        "model": "Qwen2.5-0.5B-Instruct",
        "version": 8,
        "uri": "file:///var/lib/agentstream/ckpt/8.safetensors",
        "sha256": "ab" * 32,
        "step": 800,
        "created_at_us": T0,
        "metrics": {"loss": 0.25, "reward_mean": 0.5},
        "format": "lora",
    },
    ROLLOUT_RESULT: {
        "rollout_id": "ro-7f3e2d1c",
        "attempt_id": "at-2",
        "group_id": "g-42",
        "agent_name": "math-agent",
        "status": "SUCCEEDED",
        "final_reward": 0.75,
        "completed_at_us": T0,
        "drafts": [{"model": "m", "head": b"\x08tr-1"}],
    },
    DEPLOYMENT: {
        "decision_id": "d-1",
        "model": "Qwen2.5-0.5B-Instruct",
        "version": 9,
        "action": "CANARY",
        "decided_by": "gate",
        "reason": "evaluation: 0.812 vs v8's 0.797 on 64 tasks; canary on 10% of live rollouts",
        "format": "lora",
        "stable_version": 8,
        "stable_uri": "file:///var/lib/agentstream/ckpt/v8",
        "canary_version": 9,
        "canary_share": 0.1,
        "candidate_version": None,
        "candidate_score": 0.8125,
        "stable_score": 0.796875,
        "eval_tasks": 64,
        "canary_reward": None,
        "canary_rollouts": 0,
        "stable_reward": None,
        "stable_rollouts": 0,
        "at_us": T0,
    },
    ANNOUNCEMENT: {
        "model": "SmolLM2-135M-Instruct",
        "role": "gate",
        "gated": True,
        "instance": "host-1:4242:9f2c",
        "at_us": T0,
        "live_s": 20.0,
    },
    DEAD_LETTER: {
        "source_topic": "agentstream.spans",
        "partition": 3,
        "offset": 2**40,
        "key": b"ro-7f3e2d1c",
        "value": b"\x00\xff garbage",
        "error": "magic byte is 255, expected 0",
        "error_type": "NotWireFormat",
        "at_us": T0,
    },
}


def raw_schema(file_name: str) -> dict[str, Any]:
    return json.loads((AVRO_DIR / file_name).read_text())


def newer_span_schema() -> dict[str, Any]:
    """Span as a later release might define it: one more field, one more SpanKind symbol."""
    newer = raw_schema("span.avsc")
    kind = next(field for field in newer["fields"] if field["name"] == "kind")
    kind["type"]["symbols"].append("RETRIEVAL")
    newer["fields"].append({"name": "time_to_first_token_us", "type": ["null", "long"], "default": None})
    return newer

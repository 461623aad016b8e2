"""The supervised mode's reading of a dataset file: which rollouts give samples, which are counted and skipped."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentstream.infra.config import load_config
from agentstream.infra.kafka import KafkaUnreachable
from agentstream.infra.processes import free_port
from agentstream.schemas.dataset import DatasetRow, json_line
from agentstream.trainer.sft_main import SftSummary, dataset_samples, run_sft
from tests.support.samples import CALL_1, MASK, PROMPT, TOOL


def row(rollout_id: str, response: list[int]) -> DatasetRow:
    sample = {"transition_id": f"t-{rollout_id}", "policy_version": 0, "prompt_token_ids": PROMPT,
              "response_token_ids": response, "loss_mask": list(MASK[:len(response)]), "reward": 1.0,
              "advantage": 1.0, "merged_calls": 1}
    return {"rollout_id": rollout_id, "agent_name": "a", "task_id": "t", "group_id": "g", "model": "m", "status": "OK",
            "start_time": "2026-11-27T18:45:00Z", "end_time": "2026-11-27T18:45:01Z", "reward": 1.0,
            "total_reward": 1.0, "policy_versions": [0], "messages": [], "calls": [], "samples": [sample]}


def test_token_ids_outside_the_vocabulary_skip_their_rollout_and_are_counted(tmp_path, caplog):
    """An id the model's embedding has no row for (a dataset of another tokenizer, a corrupted file) would stop the
    run inside torch with an IndexError; its rollout is skipped as invalid, the rows around it still train."""
    path = tmp_path / "d.jsonl"
    good = CALL_1 + TOOL
    rows = [row("r1", good), row("r2", [40, 10**9, 42]), row("r3", [40, 2**70]), row("r4", good),
            row("r5", [40, 300])]
    path.write_text("".join(json_line(r) for r in rows))
    summary = SftSummary()
    samples = list(dataset_samples(path, summary, vocabulary=300))
    assert [sample.rollout_id for sample in samples] == ["r1", "r4"]
    assert (summary.rollouts, summary.invalid) == (5, 3)
    assert "token id 1000000000" in caplog.text and "vocabulary of 300" in caplog.text
    assert [s.rollout_id for s in dataset_samples(path, SftSummary())] == ["r1", "r2", "r3", "r4", "r5"]


def test_a_broker_that_cannot_be_reached_stops_the_run_before_any_step(tmp_path):
    """The new checkpoint must be announced on the checkpoints topic (hot swap and the RL trainer follow it): with
    no broker, the run says so at once, a retriable KafkaUnreachable, and neither trains nor writes anything."""
    path = tmp_path / "d.jsonl"
    path.write_text(json_line(row("r1", CALL_1 + TOOL)))
    config = replace(load_config(environ={}), stack=replace(load_config(environ={}).stack, home=tmp_path))
    config = replace(config, trainer=replace(config.trainer, model="tiny", device="cpu", threads=1,
                                             checkpoint_dir=str(tmp_path / "ckpt")))
    lines: list[str] = []
    with pytest.raises(KafkaUnreachable, match=r"127\.0\.0\.1:\d+.*nothing was trained") as refused:
        run_sft(config, f"127.0.0.1:{free_port()}", path, progress=lines.append)
    assert refused.value.retriable
    assert not any(line.startswith("step") for line in lines)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").rglob("*.safetensors"))

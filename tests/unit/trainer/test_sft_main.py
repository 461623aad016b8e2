"""The supervised mode's reading of a dataset file: which rollouts give samples, which are counted and skipped."""

from __future__ import annotations

from schemas.dataset import DatasetRow, json_line
from tests.support.samples import CALL_1, MASK, PROMPT, TOOL
from trainer.sft_main import SftSummary, dataset_samples


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

"""Supervised steps on good rollouts: from the transitions topic (``objective = "supervised"``) and from an exported
dataset (``run_sft``), each ending in a checkpoint announced on the checkpoints topic that raised the good samples'
likelihood, and that the RL trainer resumes from."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from agentstream.infra.config import TrackingConfig, TrainerConfig
from agentstream.infra.kafka import create_topics, topic_name
from agentstream.models import teacher_forced_logprobs
from agentstream.schemas.dataset import DatasetRow, MalformedDatasetRow, json_line
from agentstream.trainer.checkpoint_writer import latest_manifest, open_store
from agentstream.trainer.metrics import MetricsWriter
from agentstream.trainer.policy import build_policy, load_weights
from agentstream.trainer.sft_main import NothingToTrain, run_sft
from agentstream.trainer.worker import TrainerWorker
from tests.integration.test_trainer_worker import checkpoint_events, produce, transition
from tests.support.samples import CALL_1, CALL_2, MASK, PROMPT, TOOL


def likelihood(config: TrainerConfig, folder: Path | None, pairs: list[tuple[list[int], list[int]]]) -> float:
    """Mean log-likelihood of the responses given their prompts under a checkpoint's weights (None: the initial)."""
    policy = build_policy(config)
    if folder is not None:
        load_weights(policy, folder)
    values = [v for prompt, response in pairs for v in teacher_forced_logprobs(policy.model, prompt, response, 1.0)]
    return sum(values) / len(values)


def rollout_row(rollout_id: str, reward: float | None, *, samples: bool) -> DatasetRow:
    """A dataset row of a two-call rollout: its merged trajectory sample, or (``samples`` False) only its calls."""
    response = CALL_1 + TOOL + CALL_2
    sample = {"transition_id": f"t-{rollout_id}", "policy_version": 0, "prompt_token_ids": PROMPT,
              "response_token_ids": response, "loss_mask": list(MASK), "reward": reward or 0.0, "advantage": 0.0,
              "merged_calls": 2}
    calls = [{"span_id": "s1", "policy_version": 0, "prompt_token_ids": PROMPT, "response_token_ids": CALL_1,
              "response_logprobs": [-1.0] * len(CALL_1)},
             {"span_id": "s2", "policy_version": 0, "prompt_token_ids": PROMPT + CALL_1 + TOOL,
              "response_token_ids": CALL_2, "response_logprobs": [-1.0] * len(CALL_2)}]
    return {"rollout_id": rollout_id, "agent_name": "agent", "task_id": rollout_id, "group_id": "g", "model": "m",
            "status": "OK", "start_time": "2026-11-27T18:45:00Z", "end_time": "2026-11-27T18:45:01Z",
            "reward": reward, "total_reward": reward or 0.0, "policy_versions": [0], "messages": [], "calls": calls,
            "samples": [sample] if samples else []}


@pytest.fixture
def supervised_setup(topics_config, tmp_path, stack):
    model = f"tiny-{uuid.uuid4().hex[:8]}"
    trainer = TrainerConfig(model="tiny", model_name=model, device="cpu", threads=1, lr=1e-2, batch_transitions=4,
                            batch_tokens=0, batch_wait_s=60, max_policy_lag=0, checkpoint_dir=str(tmp_path / "ckpt"),
                            session_timeout_s=3, objective="supervised", supervised_min_reward=1.0)
    config = replace(topics_config, trainer=trainer, stack=replace(topics_config.stack, home=tmp_path))
    asyncio.run(create_topics(config, stack.bootstrap_servers))
    return config, model


def test_supervised_steps_from_the_stream_then_from_a_dataset_announce_checkpoints_the_rl_trainer_resumes_from(
        supervised_setup, stack, kafka_options, tmp_path, clickhouse, stack_config):
    config, model = supervised_setup
    database = stack_config.clickhouse.database
    store = open_store(config.trainer.checkpoint_dir)
    failed = [transition(f"bad{i}", model, reward=0.0, advantage=-1.0) for i in range(2)]
    good = [transition(f"good{i}", model, reward=1.0, advantage=0.0) for i in range(4)]  # a flat, all-success group
    good_pairs = [(t["prompt_token_ids"], t["response_token_ids"]) for t in good]
    lines: list[str] = []

    async def stream() -> TrainerWorker:
        worker = TrainerWorker(config, stack.bootstrap_servers, progress=lines.append)
        await produce(kafka_options, topic_name(config.topics, "transitions"), failed + good)
        await asyncio.wait_for(worker.run(max_steps=1), 60)
        return worker

    worker = asyncio.run(stream())
    assert (worker.version, worker.summary.transitions, worker.summary.below_threshold) == (1, 4, 2)
    assert any("below threshold 2 " in line for line in lines)
    first = latest_manifest(store, model)
    assert likelihood(config.trainer, store.get(first.uri), good_pairs) > likelihood(config.trainer, None, good_pairs)

    dataset = tmp_path / "rollouts.jsonl"
    rows = [rollout_row("merged", 1.0, samples=True), rollout_row("calls", 1.0, samples=False),
            rollout_row("failed", 0.0, samples=True), rollout_row("unfinished", None, samples=False)]
    dataset.write_text("".join(map(json_line, rows)))
    tracked = replace(config, tracking=TrackingConfig(mlflow_uri=(tmp_path / "mlruns").as_uri(),
                                                      mlflow_experiment="sft-test"))
    summary = run_sft(tracked, stack.bootstrap_servers, dataset, epochs=2, progress=lines.append,
                      metrics=MetricsWriter(clickhouse, database))
    # per pass: the merged sample and the two calls kept, the failed rollout's sample below the threshold
    assert (summary.rollouts, summary.unrewarded, summary.samples, summary.below_threshold) == (4, 1, 4, 1)
    # one batcher for both passes: the second pass's first sample fills the first step (3 + 1), no step of a remainder
    assert summary.steps == 2 and summary.trained == 6 and summary.manifest.version == 2
    assert summary.manifest.offsets == first.offsets  # the RL trainer goes on reading where it stood
    trained = [(PROMPT, CALL_1), (PROMPT + CALL_1 + TOOL, CALL_2)]  # the merged sample's tool tokens are inputs only
    assert likelihood(config.trainer, store.get(summary.manifest.uri), trained) > likelihood(
        config.trainer, store.get(first.uri), trained)
    # reported as the stream trainer reports: train_steps rows, the checkpoints row, the tracker's run
    parameters = {"m": model}
    assert clickhouse.query(f"SELECT step, policy_version, transitions FROM {database}.train_steps FINAL WHERE "
                            "model = {m:String} ORDER BY step", parameters=parameters).result_rows == [
        (2, 1, 4), (3, 1, 2)]
    assert clickhouse.query(f"SELECT version, step, metrics['supervised_steps'] FROM {database}.checkpoints FINAL "
                            "WHERE model = {m:String}", parameters=parameters).result_rows == [(2, 3, 2.0)]
    tracker = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = tracker.search_runs([tracker.get_experiment_by_name("sft-test").experiment_id],
                                 f"tags.`agentstream.model` = '{model}'")
    assert (run.info.run_name, run.info.status) == (f"{model} v1→", "FINISHED")
    assert [m.step for m in tracker.get_metric_history(run.info.run_id, "loss")] == [2, 3]
    assert [a.path for a in tracker.list_artifacts(run.info.run_id, "checkpoints")] == ["checkpoints/v00000002.json"]
    events = asyncio.run(checkpoint_events(kafka_options, config))
    assert [(key, event["version"]) for key, event in events] == [(model, 1), (model, 2)]

    async def resume() -> TrainerWorker:
        rl = TrainerWorker(replace(config, trainer=replace(config.trainer, objective="policy_gradient")),
                           stack.bootstrap_servers, progress=lines.append)
        await asyncio.wait_for(rl.run(max_steps=0), 60)
        return rl

    assert asyncio.run(resume()).version == 2

    dataset.write_text(json_line(rollout_row("failed", 0.0, samples=True)))
    with pytest.raises(NothingToTrain, match="no sample of a rollout with reward >= 1"):
        run_sft(config, stack.bootstrap_servers, dataset, progress=lines.append)
    # a malformed first row fails before the model is loaded: this model does not exist
    dataset.write_text('{"rollout_id": "r"}\n')
    missing = replace(config, trainer=replace(config.trainer, model=str(tmp_path / "no-such-model")))
    with pytest.raises(MalformedDatasetRow, match="row 1"):
        run_sft(missing, stack.bootstrap_servers, dataset, progress=lines.append)

"""The trainer's runs in MLflow and W&B, read back with their own clients; a tracker that is down costs nothing.

The real trainer trains the tiny model from the real broker with ``[tracking]`` on: MLflow's
``MlflowClient`` reads the file store (the run by name and tags, its parameters, each metric's
history per optimizer step, the checkpoint manifests as artifacts) and the W&B offline run
directory is read with wandb's own ``Record`` protobuf (``tests/support/wandb_offline.py``).
Then an MLflow that refuses connections and one that accepts and never answers: the trainer
takes its steps as fast as without tracking, logs one warning and counts the failed calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from agentstream.infra.config import Config, TrackingConfig, TrainerConfig
from agentstream.infra.kafka import create_topics, topic_name
from agentstream.infra.processes import free_port
from agentstream.trainer.checkpoint_writer import manifests, open_store
from agentstream.trainer.tracking import CHECKPOINT_DIR_TAG, HELDOUT_ACCURACY, record_evaluations
from agentstream.trainer.worker import RunSummary, TrainerWorker
from tests.integration.test_trainer_worker import produce, transition
from tests.support.wandb_offline import read_offline_run

STEPS = 3


def tiny_config(topics_config: Config, folder: Path, tracking: TrackingConfig) -> tuple[Config, str]:
    """A tiny CPU trainer that steps and checkpoints on every 4 transitions, with ``tracking``."""
    model = f"tiny-{uuid.uuid4().hex[:8]}"
    trainer = TrainerConfig(model="tiny", model_name=model, device="cpu", threads=1, lr=1e-3, batch_transitions=4,
                            batch_tokens=0, batch_wait_s=60, max_policy_lag=1000,
                            checkpoint_dir=str(folder / model), session_timeout_s=3, optimizer_state_every=0)
    return replace(topics_config, trainer=trainer, tracking=tracking,
                   stack=replace(topics_config.stack, home=folder)), model


def train(config: Config, bootstrap_servers: str, kafka_options: dict, model: str) -> tuple[RunSummary, float]:
    """``STEPS`` steps of 4 transitions each; returns the summary and the seconds ``run`` took."""
    records = [transition(f"t{i}", model, advantage=1.0 if i % 2 else -1.0) for i in range(4 * STEPS)]

    async def run() -> tuple[RunSummary, float]:
        await create_topics(config, bootstrap_servers)
        await produce(kafka_options, topic_name(config.topics, "transitions"), records)
        started = time.monotonic()
        summary = await asyncio.wait_for(TrainerWorker(config, bootstrap_servers, progress=lambda line: None)
                                         .run(max_steps=STEPS), 120)
        return summary, time.monotonic() - started

    return asyncio.run(run())


def test_a_run_in_mlflow_and_wandb_reads_back_with_their_clients(topics_config, stack, kafka_options, tmp_path,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)  # file:./mlruns is relative to the trainer's working folder
    tracking = TrackingConfig(mlflow_uri="file:./mlruns", mlflow_experiment="tracking-test", wandb_mode="offline",
                              wandb_project="tracking-test", wandb_dir=str(tmp_path / "wandb-runs"))
    config, model = tiny_config(topics_config, tmp_path, tracking)
    summary, _ = train(config, stack.bootstrap_servers, kafka_options, model)
    assert (summary.steps, summary.checkpoints) == (STEPS, STEPS)
    assert (summary.tracking_failures, summary.tracking_dropped) == (0, 0)
    written = sorted(manifests(open_store(config.trainer.checkpoint_dir), model), key=lambda m: m.version)

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("tracking-test")
    (run,) = client.search_runs([experiment.experiment_id], f"tags.`agentstream.model` = '{model}'")
    assert run.info.run_name == f"{model} v0→" and run.info.status == "FINISHED"
    assert run.data.tags[CHECKPOINT_DIR_TAG] == config.trainer.checkpoint_dir
    assert run.data.tags["agentstream.first_version"] == "0"
    assert run.data.params["trainer.lr"] == "0.001" and run.data.params["model"] == model
    assert run.data.params["agentstream_version"]
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in loss] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_by_version")] == [0, 1, 2]
    for name in ("kl", "entropy", "clip_fraction", "staleness_mean", "staleness_max", "tokens_per_s",
                 "transitions", "grad_norm", "step_time_s", "policy_version"):
        assert len(client.get_metric_history(run.info.run_id, name)) == STEPS, name
    assert [m.value for m in client.get_metric_history(run.info.run_id, "transitions")] == [4.0] * STEPS
    assert sorted(m.value for m in client.get_metric_history(run.info.run_id, "checkpoint_version")) == [1, 2, 3]
    artifacts = sorted(a.path for a in client.list_artifacts(run.info.run_id, "checkpoints"))
    assert artifacts == [f"checkpoints/v{v:08d}.json" for v in (1, 2, 3)]
    logged = json.loads(Path(client.download_artifacts(run.info.run_id, artifacts[-1], str(tmp_path))).read_text())
    assert (logged["version"], logged["uri"], logged["sha256"]) == (3, written[-1].uri, written[-1].sha256)
    assert logged["trained_transitions"] == 4 and "trained_ids" not in logged
    assert logged["metrics"]["loss"] == loss[-1].value

    line = record_evaluations(tracking, config.trainer.checkpoint_dir, [(0, 0.25), (3, 0.5)])
    assert run.info.run_id in line, line
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, HELDOUT_ACCURACY)] == [(0, 0.25),
                                                                                                        (3, 0.5)]

    (folder,) = (tmp_path / "wandb-runs" / "wandb").glob("offline-run-*")
    offline = read_offline_run(folder)
    assert offline.name == f"{model} v0→" and offline.config["trainer.lr"] == "0.001"
    assert offline.config[CHECKPOINT_DIR_TAG] == config.trainer.checkpoint_dir
    rows = [row for row in offline.history if "loss" in row]
    assert [row["_step"] for row in rows] == [1, 2, 3]
    assert [row["loss"] for row in rows] == pytest.approx([m.value for m in loss])
    assert [row["policy_version"] for row in rows] == [0, 1, 2]
    assert {f"checkpoints/v{v:08d}.json" for v in (1, 2, 3)} <= set(offline.files)
    assert json.loads((folder / "files" / "checkpoints" / "v00000003.json").read_text())["sha256"] == written[-1].sha256


class SilentServer:
    """A TCP server that accepts every connection and never answers (a tracker that hangs)."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.socket.accept()[0])
            except OSError:  # closed
                return

    def close(self) -> None:
        self.socket.close()
        for connection in self.held:
            connection.close()


def test_a_tracker_that_is_down_or_hangs_neither_stops_nor_slows_training(topics_config, stack, kafka_options,
                                                                          tmp_path, caplog):
    silent = SilentServer()
    quick = {"timeout_s": 1.0, "finish_timeout_s": 2.0}  # the hanging one: each request gives up after 1 s (+1 retry)
    try:
        results: dict[str, tuple[RunSummary, float]] = {}
        messages: dict[str, list[str]] = {}
        for case, tracking in (("off", TrackingConfig()),
                               ("refused", TrackingConfig(mlflow_uri=f"http://127.0.0.1:{free_port()}",
                                                          timeout_s=1.0)),
                               ("hanging", TrackingConfig(mlflow_uri=f"http://127.0.0.1:{silent.port}", **quick))):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="agentstream.trainer.tracking"):
                config, model = tiny_config(topics_config, tmp_path, tracking)
                results[case] = train(config, stack.bootstrap_servers, kafka_options, model)
            messages[case] = [r.getMessage() for r in caplog.records if r.name == "agentstream.trainer.tracking"]
    finally:
        silent.close()
    (off, off_s), (refused, refused_s), (hanging, hanging_s) = results["off"], results["refused"], results["hanging"]
    print({case: round(seconds, 2) for case, (_, seconds) in results.items()})
    assert off.steps == refused.steps == hanging.steps == STEPS
    assert off.checkpoints == refused.checkpoints == hanging.checkpoints == STEPS
    assert messages["off"] == [] and off.tracking_failures == 0
    for case, error in (("refused", "Connection refused"), ("hanging", "Read timed out")):
        assert len(messages[case]) == 1, messages[case]  # once, not per step
        assert "MLflow at http://127.0.0.1:" in messages[case][0] and error in messages[case][0]
    assert (refused.tracking_failures, refused.tracking_dropped) == (1 + 2 * STEPS, 0)  # start, steps, checkpoints
    assert hanging.tracking_failures >= 1 and hanging.tracking_dropped >= 1  # what was queued at finish is dropped
    # a tracker call on the training path would cost a step >= 1 s (the request timeout) against a hanging tracker
    for summary in (refused, hanging):
        assert summary.last_step_at - summary.first_record_at < off.last_step_at - off.first_record_at + 1.0
    assert refused_s < off_s + 3.0
    assert hanging_s < off_s + quick["finish_timeout_s"] + 3.0

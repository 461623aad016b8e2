"""The tracker's bounded queue: the caller never waits, a slow or failing backend is counted and logged once."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from agentstream.infra.config import TrackingConfig, TrainerConfig, describe, load_config
from agentstream.infra.processes import free_port
from agentstream.trainer.tracking import (
    Channel,
    RunStart,
    Tracker,
    TrackerMissing,
    backends,
    record_evaluations,
    run_params,
    short_error,
)


class Recording:
    """A backend that records its calls; it waits for ``gate`` on every call and raises where ``fail`` says."""

    where = "the recording tracker"

    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.gate, self.fail = gate, fail
        self.calls: list[tuple[Any, ...]] = []

    def _call(self, *call: Any) -> None:
        if self.gate is not None:
            self.gate.wait()
        if self.fail:
            raise ConnectionError("tracker down")
        self.calls.append(call)

    def start(self, run: RunStart) -> None:
        self._call("start", run.name)

    def step(self, metrics: Mapping[str, float], step: int, version: int, timestamp_ms: int) -> None:
        self._call("step", step)

    def checkpoint(self, manifest: dict[str, Any], version: int, step: int) -> None:
        self._call("checkpoint", version)

    def finish(self) -> None:
        self._call("finish")


def test_a_full_queue_drops_without_waiting_and_close_gives_up_at_its_deadline(caplog):
    gate = threading.Event()
    backend = Recording(gate)
    channel = Channel(backend, size=3)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="agentstream.trainer.tracking"):
        for step in range(50):
            channel.put(lambda step=step: backend.step({}, step, 0, 0))
        assert time.monotonic() - started < 0.5  # the caller never waited on the blocked backend
        channel.close(timeout_s=0.2)
    assert channel.dropped >= 50 - 3 - 1  # one call may be in the backend's hands, 3 in the queue
    assert len(caplog.records) == 1 and "queue is full" in caplog.records[0].getMessage()
    gate.set()


def test_failures_are_counted_and_logged_once_and_calls_run_in_order(caplog):
    failing, working = Recording(fail=True), Recording()
    tracker = Tracker(TrackingConfig(finish_timeout_s=5), [failing, working])
    with caplog.at_level(logging.WARNING, logger="agentstream.trainer.tracking"):
        line = tracker.start(TrainerConfig(model="tiny"), "tiny-model", 3, "/checkpoints")
        tracker.finish()
    assert line == "tracking: run 'tiny-model v3→' in the recording tracker, the recording tracker"
    assert (tracker.failures, tracker.dropped) == (2, 0)  # start and finish of the failing one
    assert working.calls == [("start", "tiny-model v3→"), ("finish",)]
    assert [r.getMessage() for r in caplog.records] == [
        "tracking: the recording tracker failed: tracker down; training goes on, and what fails or is dropped from "
        "now on is only counted (in the trainer's last line)"]
    assert tracker.summary() == ("tracking: the recording tracker, the recording tracker; 2 failed calls, 0 dropped")


def test_off_by_default_is_no_backend_and_no_thread():
    before = threading.active_count()
    tracker = Tracker(TrackingConfig())
    assert tracker.channels == [] and threading.active_count() == before
    assert tracker.start(TrainerConfig(), "m", 0, "c") == "" and tracker.summary() == ""


def test_a_missing_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # Python's own way to make a package unimportable
    with pytest.raises(TrackerMissing, match=r"pip install 'agentstream\[wandb\]'"):
        backends(TrackingConfig(wandb_mode="offline"))


def test_params_are_the_trainer_settings_without_secrets():
    params = run_params(TrainerConfig(model="tiny", lr=0.002), "tiny-model")
    assert params["trainer.lr"] == "0.002" and params["model"] == "tiny-model" and params["agentstream_version"]
    assert "trainer.reference_model" not in params  # unset
    assert not any("Secret" in value for value in params.values())


def test_short_error_names_the_class_and_the_innermost_cause_in_one_line():
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as cause:
            raise RuntimeError("API request to http://x/api failed with exception " + "context " * 80) from cause
    except RuntimeError as error:
        assert short_error(error) == "RuntimeError (ConnectionRefusedError: [Errno 111] Connection refused)"
    assert short_error(ValueError("first line\nsecond line")) == "ValueError: first line"
    long = short_error(ValueError("x" * 500), limit=20)
    assert long == "ValueError: " + "x" * 19 + "…"
    assert short_error(KeyError()) == "KeyError"


def test_an_unreachable_mlflow_is_one_short_line_with_its_address(caplog):
    pytest.importorskip("mlflow")
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens
    with caplog.at_level(logging.DEBUG, logger="agentstream.trainer.tracking"):
        line = record_evaluations(TrackingConfig(mlflow_uri=uri, timeout_s=1, finish_timeout_s=30), "/ckpt",
                                  [(0, 0.5)])
    assert line.startswith(f"tracking: MLflow at {uri} could not be reached (MlflowException (") and len(line) < 250
    assert "heldout_accuracy not logged" in line and "\n" not in line
    assert any("Max retries exceeded" in str(record.exc_info[1]) for record in caplog.records if record.exc_info)


@pytest.mark.parametrize("uri, shown", [
    ("http://alice:s3cret@127.0.0.1:1", "http://alice:***@127.0.0.1:1"),
    ("postgresql://mlflow:s3cret@127.0.0.1:1/mlflow", "postgresql://mlflow:***@127.0.0.1:1/mlflow"),
])
def test_a_password_in_the_mlflow_uri_is_never_printed(uri, shown, caplog, monkeypatch):
    """A database URI holds its password (MLflow has no other way to get it): the trainer's warning and last line,
    and `agentstream config`, show the URI with the password masked."""
    for name, value in (("MAX_RETRIES", "0"), ("BACKOFF_FACTOR", "0"), ("TIMEOUT", "1")):
        monkeypatch.setenv(f"MLFLOW_HTTP_REQUEST_{name}", value)  # a refused connection fails at once
    tracker = Tracker(TrackingConfig(mlflow_uri=uri, finish_timeout_s=20))
    with caplog.at_level(logging.WARNING, logger="agentstream.trainer.tracking"):
        line = tracker.start(TrainerConfig(model="tiny"), "tiny-model", 0, "/checkpoints")
        tracker.finish()
    assert tracker.failures >= 1 and caplog.records
    printed = "\n".join([line, tracker.summary(), caplog.text])
    assert shown in printed and "s3cret" not in printed
    view = describe(load_config(environ={"AGENTSTREAM_MLFLOW_URI": uri}))
    assert view["tracking"]["mlflow_uri"] == shown

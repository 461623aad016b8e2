"""Experiment tracking: the trainer's runs in MLflow and Weights & Biases, never on the training path.

A run is named by the model and the version it starts from (``SmolLM2-135M-Instruct v0→``) and
tagged with the model, a run id, the first version and the checkpoint folder; its parameters
are the trainer's configuration (flattened, secrets left out), the model and agentstream's
version. Each optimizer step logs the ``StepReport``'s numbers at step = optimizer step, and
the step's mean reward at step = policy version (``reward_by_version``); each checkpoint logs
its manifest as a JSON artifact (never the weights) and ``checkpoint_version``.

Every backend runs on a thread of its own behind a bounded queue: the trainer only enqueues.
A tracker that is down or slow costs training nothing: each failed call is counted (the first
logged with the tracker's address and the error), a call that finds the queue full is dropped
and counted, and stopping waits for the queue at most ``finish_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

from agentstream.infra.config import Secret, TrackingConfig, TrainerConfig, masked_uris, uri_scheme
from agentstream.schemas.errors import AgentstreamError
from agentstream.trainer.checkpoint_writer import Manifest
from agentstream.trainer.metrics import StepReport

log = logging.getLogger("agentstream.trainer.tracking")
_SET_BY_US: set[str] = set()  # the MLflow environment variables this process set (the others are the user's)

STEP_METRICS = tuple(f.name for f in dataclasses.fields(StepReport) if f.name not in ("model", "step", "created_at"))
"""The StepReport numbers logged at every optimizer step."""
REWARD_BY_VERSION = "reward_by_version"
CHECKPOINT_VERSION = "checkpoint_version"
HELDOUT_ACCURACY = "heldout_accuracy"
CHECKPOINT_DIR_TAG = "agentstream.checkpoint_dir"


class TrackerMissing(AgentstreamError, ImportError):
    """Tracking is configured but its client is not installed: install the extra the message names."""

    retriable = False


@dataclass(frozen=True)
class RunStart:
    """What a run starts with: its name, tags and parameters (all strings)."""

    name: str
    tags: dict[str, str]
    params: dict[str, str]


class Backend(Protocol):
    """One tracker's client; every method runs on the tracker's own thread and may raise."""

    where: str  # the tracker's kind and address, for the log line

    def start(self, run: RunStart) -> None: ...

    def step(self, metrics: Mapping[str, float], step: int, version: int, timestamp_ms: int) -> None: ...

    def checkpoint(self, manifest: dict[str, Any], version: int, step: int) -> None: ...

    def finish(self) -> None: ...


def _require(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise TrackerMissing(f"[tracking] asks for {extra} but the {module} package is not installed: "
                             f"pip install 'agentstream[{extra}]'")


def _local_uri(uri: str) -> str:
    """A file store's URI made absolute (``file:./mlruns`` -> ``file:///cwd/mlruns``); other URIs as given."""
    scheme = uri_scheme(uri)
    if scheme not in ("", "file"):
        return uri
    path = uri.removeprefix("file://") if uri.startswith("file://") else uri.removeprefix("file:")
    return Path(path).resolve().as_uri()


def prepare_mlflow(uri: str, timeout_s: float) -> None:
    """Make MLflow's HTTP client give up within about ``2 × timeout_s`` rather than its minutes of retries.

    MLflow reads these from the environment at every request; a value the user set is kept.
    MLflow 3 keeps its file store in maintenance mode and refuses it unless asked: a ``file:``
    URI in ``[tracking]`` is that request.
    """
    settings = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, round(timeout_s)))}
    if uri_scheme(uri) in ("", "file"):
        settings["MLFLOW_ALLOW_FILE_STORE"] = "true"
    for name, value in settings.items():
        if name not in os.environ or name in _SET_BY_US:
            os.environ[name] = value
            _SET_BY_US.add(name)


class MlflowBackend:
    """A run in an MLflow experiment, through ``MlflowClient`` (mlflow-skinny), created on its first call."""

    def __init__(self, settings: TrackingConfig) -> None:
        _require("mlflow", "mlflow")
        self.uri = _local_uri(settings.mlflow_uri)
        self.experiment = settings.mlflow_experiment
        self.where = f"MLflow at {masked_uris(self.uri)}"
        self.run_id: str | None = None
        self._start: RunStart | None = None
        self._client: Any = None
        prepare_mlflow(self.uri, settings.timeout_s)

    def start(self, run: RunStart) -> None:
        self._start = run
        self._run()

    def _run(self) -> str:
        """The run's id, creating the run first where an earlier try failed (the tracker was down)."""
        if self.run_id is not None:
            return self.run_id
        assert self._start is not None  # the tracker enqueues start first
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = self._client = self._client or MlflowClient(tracking_uri=self.uri)
        experiment = client.get_experiment_by_name(self.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.experiment)
        self.run_id = client.create_run(experiment_id, run_name=self._start.name, tags=self._start.tags).info.run_id
        params = [Param(key, value[:6000]) for key, value in self._start.params.items()]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 parameters a request
            client.log_batch(self.run_id, params=params[first:first + 100])
        return self.run_id

    def step(self, metrics: Mapping[str, float], step: int, version: int, timestamp_ms: int) -> None:
        from mlflow.entities import Metric

        batch = [Metric(key, float(value), timestamp_ms, step) for key, value in metrics.items()]
        batch.append(Metric(REWARD_BY_VERSION, float(metrics["reward_mean"]), timestamp_ms, version))
        run_id = self._run()
        self._client.log_batch(run_id, metrics=batch)

    def checkpoint(self, manifest: dict[str, Any], version: int, step: int) -> None:
        run_id = self._run()
        self._client.log_text(run_id, json.dumps(manifest, indent=2), f"checkpoints/v{version:08d}.json")
        self._client.log_metric(run_id, CHECKPOINT_VERSION, float(version), step=step)

    def finish(self) -> None:
        if self.run_id is not None:
            self._client.set_terminated(self.run_id)


class WandbBackend:
    """A Weights & Biases run, offline (a run directory under ``wandb_dir``) or online."""

    def __init__(self, settings: TrackingConfig) -> None:
        _require("wandb", "wandb")
        self.settings = settings
        self.folder = Path(settings.wandb_dir or ".").resolve()
        self.where = f"Weights & Biases ({settings.wandb_mode}, project {settings.wandb_project}, {self.folder})"
        self.run: Any = None

    def start(self, run: RunStart) -> None:
        import wandb

        self.folder.mkdir(parents=True, exist_ok=True)
        mode: Literal["offline", "online"] = "offline" if self.settings.wandb_mode == "offline" else "online"
        self.run = wandb.init(
            mode=mode, project=self.settings.wandb_project, dir=str(self.folder), name=run.name,
            config={**run.params, **run.tags}, reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", init_timeout=self.settings.timeout_s))
        self.run.define_metric(REWARD_BY_VERSION, step_metric="policy_version")

    def step(self, metrics: Mapping[str, float], step: int, version: int, timestamp_ms: int) -> None:
        self.run.log({**metrics, REWARD_BY_VERSION: metrics["reward_mean"]}, step=step)

    def checkpoint(self, manifest: dict[str, Any], version: int, step: int) -> None:
        path = Path(self.run.dir) / "checkpoints" / f"v{version:08d}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(manifest, indent=2))
        self.run.save(str(path), base_path=self.run.dir, policy="now")
        self.run.log({CHECKPOINT_VERSION: version}, commit=False)  # joins the current step's row

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


class Channel:
    """One backend's bounded queue and the thread that drains it; counts failed and dropped calls."""

    def __init__(self, backend: Backend, size: int) -> None:
        self.backend = backend
        self.failures = 0
        self.dropped = 0
        self._warned = False
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(size)
        self._thread = threading.Thread(target=self._drain, name="tracking", daemon=True)
        self._thread.start()

    def put(self, call: Callable[[], None]) -> None:
        """Enqueue ``call`` without waiting; a full queue drops it (counted)."""
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            self.dropped += 1
            self._warn("is too slow: calls are dropped while its queue is full")

    def _warn(self, problem: str) -> None:
        """Log the first problem only: a tracker that is down would otherwise write a line per step."""
        if not self._warned:
            self._warned = True
            log.warning("tracking: %s %s; training goes on, and what fails or is dropped from now on is only counted "
                        "(in the trainer's last line)", self.backend.where, masked_uris(problem))

    def _drain(self) -> None:
        while (call := self._queue.get()) is not None:
            try:
                call()
            except Exception as error:  # a tracker fails in many ways (HTTP, files, its own errors); none stops us
                self.failures += 1
                self._warn(f"failed: {error}")

    def close(self, timeout_s: float) -> None:
        """Finish the run after what is queued, waiting at most ``timeout_s``; what is left then counts as dropped."""
        deadline = time.monotonic() + timeout_s
        self.put(self.backend.finish)
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self.dropped += self._queue.qsize()
            self._warn(f"did not finish within {timeout_s:.0f} s: what was still queued is dropped")


def backends(settings: TrackingConfig) -> list[Backend]:
    """The backends ``[tracking]`` configures (none by default); raises TrackerMissing for a client not installed."""
    found: list[Backend] = []
    if settings.mlflow_uri:
        found.append(MlflowBackend(settings))
    if settings.wandb_mode:
        found.append(WandbBackend(settings))
    return found


def run_params(trainer: TrainerConfig, model: str) -> dict[str, str]:
    """The run's parameters: the trainer's settings (``trainer.<key>``, secrets left out), the model, our version."""
    params = {f"trainer.{key}": str(value) for key, value in dataclasses.asdict(trainer).items()
              if value is not None and not isinstance(value, Secret)}
    try:
        version = importlib.metadata.version("agentstream")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {**params, "model": model, "agentstream_version": version}


def manifest_document(manifest: Manifest) -> dict[str, Any]:
    """The manifest as logged: everything but the trained transition ids, which are replaced by their count."""
    document = dataclasses.asdict(manifest)
    document["trained_transitions"] = len(document.pop("trained_ids"))
    return document


class Tracker:
    """The trainer's side: start, a step, a checkpoint, finish; each call only enqueues work for every backend."""

    def __init__(self, settings: TrackingConfig, found: list[Backend] | None = None) -> None:
        self.settings = settings
        self.channels = [Channel(backend, settings.queue_size)
                         for backend in (backends(settings) if found is None else found)]

    @property
    def failures(self) -> int:
        return sum(channel.failures for channel in self.channels)

    @property
    def dropped(self) -> int:
        return sum(channel.dropped for channel in self.channels)

    def start(self, trainer: TrainerConfig, model: str, first_version: int, checkpoint_dir: str) -> str:
        """Start the run ``<model> v<first_version>→``, tagged so the demo and a user find it; returns a line."""
        if not self.channels:
            return ""
        run = RunStart(name=f"{model} v{first_version}→",
                       tags={"agentstream.model": model, "agentstream.run": uuid.uuid4().hex[:12],
                             "agentstream.first_version": str(first_version), CHECKPOINT_DIR_TAG: checkpoint_dir},
                       params=run_params(trainer, model))
        for channel in self.channels:
            channel.put(partial(channel.backend.start, run))
        return f"tracking: run {run.name!r} in {', '.join(channel.backend.where for channel in self.channels)}"

    def step(self, report: StepReport) -> None:
        if not self.channels:
            return
        metrics = {name: float(getattr(report, name)) for name in STEP_METRICS}
        timestamp_ms = int(report.created_at.timestamp() * 1000)
        for channel in self.channels:
            channel.put(partial(channel.backend.step, metrics, report.step, report.policy_version, timestamp_ms))

    def checkpoint(self, manifest: Manifest) -> None:
        if not self.channels:
            return
        document = manifest_document(manifest)
        for channel in self.channels:
            channel.put(partial(channel.backend.checkpoint, document, manifest.version, manifest.step))

    def finish(self) -> None:
        """Finish every run, waiting at most ``finish_timeout_s`` in all; what is still queued then is dropped."""
        deadline = time.monotonic() + self.settings.finish_timeout_s
        for channel in self.channels:
            channel.close(max(0.0, deadline - time.monotonic()))

    def summary(self) -> str:
        """One line for the trainer's last words: where the runs went, and what failed or was dropped."""
        if not self.channels:
            return ""
        where = ", ".join(channel.backend.where for channel in self.channels)
        return f"tracking: {where}; {self.failures} failed calls, {self.dropped} dropped"


def short_error(error: BaseException, limit: int = 120) -> str:
    """The error's class and, from the innermost error behind it, the class and first line of text (cut at ``limit``).

    A tracker's client wraps the cause in pages of context (MLflow's connection error is one line of
    over 500 characters); a line for people wants what failed, e.g. ``MlflowException
    (ConnectionRefusedError: [Errno 111] Connection refused)``.
    """
    root, seen = error, {id(error)}
    while (cause := root.__cause__ or root.__context__) is not None and id(cause) not in seen:
        root = cause
        seen.add(id(cause))
    text = next(iter(str(root).strip().splitlines()), "")
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    detail = f"{type(root).__name__}: {text}" if text else type(root).__name__
    return detail if root is error else f"{type(error).__name__} ({detail})"


def record_evaluations(settings: TrackingConfig, checkpoint_dir: str, points: list[tuple[int, float]],
                       metric: str = HELDOUT_ACCURACY) -> str:
    """Log ``(policy version, value)`` points into the trainer's MLflow run of ``checkpoint_dir``; returns one line.

    The run is the one tagged with that checkpoint folder (the trainer's, in this session). The
    calls run on a thread of their own for at most ``settings.finish_timeout_s``; any failure is
    reported in the returned line (a password in the URI masked), never raised.
    """
    outcome: list[str] = []

    def log_points() -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=_local_uri(settings.mlflow_uri))
        experiment = client.get_experiment_by_name(settings.mlflow_experiment)
        runs = client.search_runs([experiment.experiment_id], f"tags.`{CHECKPOINT_DIR_TAG}` = '{checkpoint_dir}'",
                                  order_by=["attributes.start_time DESC"], max_results=1) if experiment else []
        if not runs:
            outcome.append(f"tracking: no MLflow run of {checkpoint_dir} in {settings.mlflow_experiment!r} at "
                           f"{_local_uri(settings.mlflow_uri)}; {metric} not logged")
            return
        now = int(time.time() * 1000)
        client.log_batch(runs[0].info.run_id,
                         metrics=[Metric(metric, value, now, version) for version, value in points])
        outcome.append(f"tracking: {metric} logged into MLflow run {runs[0].info.run_id} "
                       f"({runs[0].info.run_name}) at {_local_uri(settings.mlflow_uri)}")

    def attempt() -> None:
        try:
            log_points()
        except Exception as error:  # as in Channel: whatever the tracker raises, the caller goes on
            log.debug("tracking: %s not logged into MLflow at %s", metric, _local_uri(settings.mlflow_uri),
                      exc_info=error)
            outcome.append(f"tracking: MLflow at {_local_uri(settings.mlflow_uri)} could not be reached "
                           f"({short_error(error)}); {metric} not logged (the trainer's log counts its failed calls)")

    if not settings.mlflow_uri:
        return ""
    _require("mlflow", "mlflow")
    prepare_mlflow(settings.mlflow_uri, settings.timeout_s)
    thread = threading.Thread(target=attempt, name="tracking", daemon=True)
    thread.start()
    thread.join(settings.finish_timeout_s)
    return masked_uris(outcome[0] if outcome else (f"tracking: MLflow at {_local_uri(settings.mlflow_uri)} did not "
                                                   f"answer within {settings.finish_timeout_s:.0f} s; {metric} not "
                                                   f"logged"))

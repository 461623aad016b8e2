"""The [tracking] section: which experiment trackers (MLflow, Weights & Biases) the trainer logs to, and URI helpers."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentstream.infra.config.checks import Checks

MLFLOW_SCHEMES = ("file", "http", "https", "databricks", "sqlite", "postgresql", "mysql", "mssql")
"""The tracking URI schemes MLflow's client takes (a bare path is a file store; the SQL ones need full ``mlflow``)."""
WANDB_MODES = ("", "offline", "online")


_URI_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s@]*@")


def masked_uris(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` in it shown as ``***``.

    For printing a URI (a database URI for MLflow holds its password) or an error that quotes one.
    """
    return _URI_PASSWORD.sub(r"\1***@", text)


def uri_scheme(uri: str) -> str:
    """The scheme of a URI, lowercased (``file:./mlruns`` -> ``file``); empty for a bare path."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", uri)
    return match.group(1).lower() if match else ""


@dataclass(frozen=True)
class TrackingConfig:
    """Where the trainer logs its runs for experiment trackers: MLflow, Weights & Biases, both or neither (the default).

    ``mlflow_uri`` is an MLflow tracking URI (``file:./mlruns`` or a folder for a local file store,
    ``http://host:5000`` for a tracking server; empty: off), its runs in ``mlflow_experiment``.
    ``wandb_mode`` is ``offline`` (a run directory under ``wandb_dir``, uploaded later with
    ``wandb sync``) or ``online`` (empty: off), in ``wandb_project``. Every call to a tracker is made
    on a thread of its own behind a queue of ``queue_size`` items: a tracker that is down or slow
    never stops or slows training (its failures and the items dropped are counted and logged). An
    HTTP request to MLflow gives up after ``timeout_s`` (and one retry); when the trainer stops, it
    waits at most ``finish_timeout_s`` for the queue to drain. See docs/tracking.md.
    """

    mlflow_uri: str = ""
    mlflow_experiment: str = "agentstream"
    wandb_mode: str = ""
    wandb_project: str = "agentstream"
    wandb_dir: str = ""
    queue_size: int = 1000
    timeout_s: float = 10.0
    finish_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        check = Checks("tracking", self)
        uri = self.mlflow_uri
        check.that(uri == uri.strip(), f"mlflow_uri {uri!r} has spaces around it (a blank one would turn tracking "
                                       f"on into a folder of that name); leave it empty for off")
        typo = re.match(r"(https?)/", uri, re.IGNORECASE)  # a folder path to MLflow: runs in ./http/host:port
        check.that(not typo, f"mlflow_uri {uri!r} lacks the colon of {typo.group(1).lower() if typo else ''}://")
        scheme = uri_scheme(uri)
        check.that(scheme.split("+", 1)[0] in ("", *MLFLOW_SCHEMES),  # postgresql+psycopg2: the driver follows a +
                   f"mlflow_uri: MLflow cannot take the scheme {scheme!r} of {uri!r}; use a folder, file:, "
                   f"http(s)://, databricks or a database URI")
        check.that(not uri or bool(self.mlflow_experiment), "mlflow_experiment must name an experiment")
        check.must("wandb_mode", self.wandb_mode in WANDB_MODES, "be offline, online or empty (off)")
        check.that(not self.wandb_mode or bool(self.wandb_project), "wandb_project must name a project")
        check.at_least("queue_size", 1)
        check.above("timeout_s", 0)
        check.at_least("finish_timeout_s", 0)

    @property
    def enabled(self) -> bool:
        return bool(self.mlflow_uri or self.wandb_mode)

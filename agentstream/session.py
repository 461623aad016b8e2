"""Online training as processes around a running stack: model server, proxy, streams, trainer, hot swap, runners.

Each part is the ordinary ``agentstream`` command in its own process, configured by one TOML
file written from the caller's effective configuration, with its output in a log file. This
is what ``agentstream train`` and the demo start; in production the same commands run as
separate deployments.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from agentstream.infra.config import Config, dump_toml
from agentstream.infra.processes import free_port, wait_for_port
from agentstream.models import model_display_name
from agentstream.pipeline.proxy.access import proxy_client_key
from agentstream.schemas.errors import AgentstreamError
from agentstream.stack.control import Endpoints


class ChildFailed(AgentstreamError, RuntimeError):
    """A process of the session exited or did not become ready; the message ends with its log."""


class Child:
    """One ``agentstream`` command in a subprocess, its output appended to a log file; ``cwd``: its working folder."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path,
                 cwd: Path | None = None) -> None:
        self.name, self.args, self.env, self.log_path, self.cwd = name, args, env, log_path, cwd
        self.process: subprocess.Popen | None = None

    def start(self) -> Child:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "agentstream", *self.args], env=self.env,
                                            cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, characters: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-characters:]
        except FileNotFoundError:
            return ""

    def check(self) -> None:
        """Raise ChildFailed if the process has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise ChildFailed(f"{self.name} exited with code {self.process.returncode}; "
                              f"its log ({self.log_path}) ends with:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        process = self.process
        if process is None or process.poll() is not None:  # not running
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class SessionPlan:
    """What to run: the agent, the model it calls and trains, and how many rollouts at once.

    ``server_url`` points at a model server that is already running (vLLM, or a dev server);
    without it the session starts ``servers`` of ``agentstream serve-model --model {model}``
    behind one proxy. Several each get a hot swap of their own with a checkpoint cache of its
    own, as replicas on separate hosts have. Without ``trainer`` no ``train-worker`` runs: the
    checkpoints come from elsewhere (``agentstream sft``, see ``run_command``) or from trainers
    started one per trained model (``start_trainer``). ``served_names`` are the trained models the
    one model server answers to, each by its own adapters (``--served-model-name``), with a hot
    swap each; empty: the trainer's one model.
    """

    agent: str
    model: str = "smollm2"
    runners: int = 1
    concurrency: int = 32
    server_url: str | None = None
    server_threads: int = 1
    servers: int = 1
    trainer: bool = True
    served_names: tuple[str, ...] = ()


class TrainingSession:
    """Starts, watches and stops the processes of one online-training session."""

    def __init__(self, config: Config, endpoints: Endpoints, workdir: Path, plan: SessionPlan) -> None:
        self.config, self.endpoints, self.workdir, self.plan = config, endpoints, workdir, plan
        self.children: dict[str, Child] = {}
        self.server_urls = ([plan.server_url] if plan.server_url
                            else [f"http://127.0.0.1:{free_port()}" for _ in range(plan.servers)])
        self.server_url = self.server_urls[0]  # the replica the gate and the demo's snapshots ask
        self.proxy_url = f"http://127.0.0.1:{free_port()}"
        self.proxy_key = proxy_client_key(config)  # the proxy it starts reads the same [security] proxy_keys

    def _env(self, threads: int, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        # PASSIVE: a torch thread that waits yields its core, since the model server and the trainer share them
        env.update(AGENTSTREAM_CONFIG=str(self.workdir / "agentstream.toml"), OMP_NUM_THREADS=str(threads),
                   OMP_WAIT_POLICY="PASSIVE",
                   KAFKA_BOOTSTRAP_SERVERS=self.endpoints.bootstrap_servers,
                   CLICKHOUSE_URL=self.endpoints.clickhouse_url, PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def _start(self, name: str, args: list[str], threads: int = 1, **extra: str) -> Child:
        child = Child(name, args, self._env(threads, extra), self.workdir / f"{name}.log").start()
        self.children[name] = child
        return child

    def start(self, progress=print, model_timeout_s: float = 300.0) -> None:
        """Start every process and wait until the model server and the proxy answer."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "agentstream.toml"
        config_path.write_text(dump_toml(self.config))
        config_path.chmod(0o600)  # it may hold credentials
        servers = list(zip(self.server_names, self.server_urls, strict=True))
        names = [option for name in self.plan.served_names for option in ("--served-model-name", name)]
        for name, url in servers if self.plan.server_url is None else []:
            self._start(name, ["serve-model", "--model", self.plan.model, "--port", url.rsplit(":", 1)[1],
                               "--threads", str(self.plan.server_threads), *names], self.plan.server_threads)
            progress(f"model server  {self.plan.model} at {url} (loading)")
        self._start("proxy", ["proxy", "--port", self.proxy_url.rsplit(":", 1)[1],
                              *[option for url in self.server_urls for option in ("--upstream", url)]])
        self._start("streams", ["streams", "--loglevel", "warning"])
        if self.plan.trainer:
            self._start("trainer", ["train-worker"], self.config.trainer.threads)
        trained = self.config.trainer.model_name or model_display_name(self.plan.model)
        for model in self.plan.served_names:  # one server: a hot swap per trained model, each into its adapters
            self._start(f"hotswap-{model}", ["hotswap", "--server", self.server_url, "--model", model])
        for number, (name, url) in enumerate(servers if not self.plan.served_names else []):
            if len(servers) == 1:
                self._start("hotswap", ["hotswap", "--server", url, "--model", trained])
            else:  # each downloads into a cache of its own and loads from there, as beside a replica on its host
                self._start(f"hotswap-{number}", ["hotswap", "--server", url, "--model", trained],
                            AGENTSTREAM_CHECKPOINT_CACHE=str(self.workdir / name / "checkpoint-cache"))
        if self.config.deploy.gate:
            self._start("gate", ["gate", "--model", trained, "--server", self.server_url, "--proxy", self.proxy_url])
        for name, url in servers:
            self.wait_until_healthy(url + "/health", name, model_timeout_s)
        wait_for_port("127.0.0.1", int(self.proxy_url.rsplit(":", 1)[1]), 30)
        started = ", ".join(["streams", *(["trainer"] if self.plan.trainer else []),
                             *(["gate"] if self.config.deploy.gate else [])])
        progress(f"proxy         {self.proxy_url} -> {', '.join(self.server_urls)}; {started} and hot swap started")

    @property
    def server_names(self) -> list[str]:
        """The log and process names of the model servers the session starts."""
        if len(self.server_urls) == 1:
            return ["model-server"]
        return [f"model-server-{number}" for number in range(self.plan.servers)]

    def start_runners(self, progress=print) -> None:
        """Start the runner processes that take tasks from the queue."""
        for number in range(self.plan.runners):
            self._start(f"runner-{number}", ["run", self.plan.agent, "--proxy", self.proxy_url,
                                             "--concurrency", str(self.plan.concurrency)])
        progress(f"runners       {self.plan.runners} x {self.plan.concurrency} rollouts at once of {self.plan.agent}")

    def run_command(self, name: str, args: list[str], threads: int = 1, timeout_s: float = 600.0) -> str:
        """Run one ``agentstream`` command to its end beside the session's processes (same configuration and stack,
        its output in ``<name>.log``); returns that output. ChildFailed if it fails or runs past ``timeout_s``."""
        child = Child(name, args, self._env(threads, {}), self.workdir / f"{name}.log").start()
        assert child.process is not None  # start() made it
        try:
            code = child.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.stop()
            raise ChildFailed(f"{name} did not finish within {timeout_s:.0f} s; its log ({child.log_path}) ends "
                              f"with:\n{child.log_tail()}") from None
        if code:
            child.check()  # raises, naming the exit code and the log's end
        return child.log_path.read_text(errors="replace")

    def start_trainer(self, name: str, config: Config) -> Child:
        """A ``train-worker`` on a configuration of its own (one trained model of several); logs to ``<name>.log``."""
        path = self.workdir / f"{name}.toml"
        path.write_text(dump_toml(config))
        path.chmod(0o600)
        return self._start(name, ["train-worker"], config.trainer.threads, AGENTSTREAM_CONFIG=str(path))

    def wait_until_healthy(self, url: str, name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if name in self.children:
                self.children[name].check()
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise ChildFailed(f"{name} did not answer at {url} within {timeout_s:.0f} s") from None
                time.sleep(0.5)

    def check(self) -> None:
        """Raise ChildFailed if any process of the session has exited."""
        for child in self.children.values():
            child.check()

    def retire(self, name: str) -> None:
        """Stop a process whose work is done, and stop watching it (``check`` would call its exit a failure)."""
        self.children.pop(name).stop()

    def stop(self, *names: str) -> None:
        """Stop the named processes (all of them, runners first, when none are named)."""
        order = names or [*(n for n in self.children if n.startswith("runner")),
                          *(n for n in self.children if n.startswith("trainer")), "gate",
                          *(n for n in self.children if n.startswith("hotswap")), "streams", "proxy",
                          *self.server_names]
        for name in order:
            if name in self.children:
                self.children[name].stop()



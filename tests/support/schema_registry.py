"""A Schema Registry server process (``python -m stack.schema_registry``) on a free loopback port, for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from agentstream.infra.processes import free_port, wait_for_port
from agentstream.infra.registry_client import RegistryClient


class RegistryProcess:
    """One registry server process over a Kafka topic; stopped by its PID."""

    def __init__(self, bootstrap_servers: str, topic: str, log_path: Path, ids: str = "fingerprint",
                 seed: bool = True, port: int | None = None) -> None:
        self.bootstrap_servers, self.topic, self.log_path, self.ids, self.seed = (
            bootstrap_servers, topic, log_path, ids, seed)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> RegistryProcess:
        command = [sys.executable, "-m", "agentstream.stack.registry_server", "--host", "127.0.0.1",
                   "--port", str(self.port),
                   "--bootstrap-servers", self.bootstrap_servers, "--topic", self.topic, "--ids", self.ids]
        if not self.seed:
            command.append("--no-seed")
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTSTREAM_", "SCHEMA_REGISTRY_"))}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                            cwd=Path(__file__).resolve().parents[2])
        wait_for_port("127.0.0.1", self.port, timeout_s, self.process, self.log_path)
        return self

    def stop(self) -> None:
        stop_child(self.process)
        self.process = None


def stop_child(process: subprocess.Popen | None, timeout_s: float = 15) -> None:
    """SIGTERM a server this test started, and SIGKILL it if it has not exited after ``timeout_s``."""
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def register_users_subjects(url: str) -> None:
    """Three subjects of a user's own (ids 1 to 3 in a registry numbering from 1), before agentstream comes."""
    client = RegistryClient(url)
    for index in range(3):
        client.register(f"orders-{index}-value", json.dumps(
            {"type": "record", "name": f"Order{index}", "fields": [{"name": "id", "type": "long"}]}))

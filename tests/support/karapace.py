"""Karapace, Aiven's Confluent-compatible Schema Registry, as a process of a test's own over a Kafka topic.

No package registry agentstream installs from serves Karapace, so the tests that use it are opt-in:
``AGENTSTREAM_KARAPACE`` names the command that starts it (a Karapace installed from its source, e.g.
``/opt/karapace/.venv/bin/python -m karapace``), configured here through its ``KARAPACE_*`` variables.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agentstream.infra.processes import ServiceError, free_port
from tests.support.schema_registry import stop_child

COMMAND_VARIABLE = "AGENTSTREAM_KARAPACE"


def karapace_command() -> list[str] | None:
    """The command that starts Karapace, from ``AGENTSTREAM_KARAPACE``; None when it is not set."""
    command = os.environ.get(COMMAND_VARIABLE, "").strip()
    return shlex.split(command) if command else None


class KarapaceProcess:
    """One Karapace registry on a free loopback port, its schemas on its own topic; stopped by its PID."""

    def __init__(self, command: list[str], bootstrap_servers: str, log_path: Path, authfile: Path | None = None
                 ) -> None:
        self.command, self.bootstrap_servers, self.log_path, self.authfile = (
            command, bootstrap_servers, log_path, authfile)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = ""
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> KarapaceProcess:
        """Start it and wait until it has elected itself primary and read its topic: only then does it register."""
        settings = {"BOOTSTRAP_URI": self.bootstrap_servers, "HOST": "127.0.0.1", "PORT": str(self.port),
                    "ADVERTISED_HOSTNAME": "127.0.0.1", "REGISTRY_HOST": "127.0.0.1",
                    "REGISTRY_PORT": str(self.port), "TOPIC_NAME": f"_schemas.karapace.{self.port}",
                    "GROUP_ID": f"karapace-{self.port}", "KARAPACE_REST": "false", "LOG_LEVEL": "INFO"}
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTSTREAM_", "KARAPACE_"))}
        if self.authfile is not None:
            settings["REGISTRY_AUTHFILE"] = str(self.authfile)
        environment.update({f"KARAPACE_{key}": value for key, value in settings.items()})
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=environment)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServiceError(f"Karapace exited with status {self.process.returncode}: see {self.log_path}")
            health = self._health()
            status = health.get("status", {})
            if status.get("schema_registry_ready") and status.get("schema_registry_is_primary"):
                self.version = str(health.get("karapace_version", ""))
                return self
            time.sleep(0.2)
        self.stop()
        raise ServiceError(f"Karapace was not ready as primary within {timeout_s:.0f}s: see {self.log_path}")

    def _health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"{self.url}/_health", timeout=2) as response:
                return dict(json.loads(response.read()))
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def stop(self) -> None:
        stop_child(self.process)
        self.process = None


def write_authfile(path: Path, username: str, password: str) -> Path:
    """A Karapace auth file (its documented format) where ``username`` may read and write everything, no one else."""
    salt = secrets.token_urlsafe(16)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt.encode(), 5000)
    path.write_text(json.dumps({
        "users": [{"username": username, "algorithm": "sha512", "salt": salt,
                   "password_hash": base64.b64encode(digest).decode()}],
        "permissions": [{"username": username, "operation": "Write", "resource": ".*"}],
    }))
    return path

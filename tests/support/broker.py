"""A tansu broker of a test's own, in memory, that the test may SIGKILL and restart (the session stack's must live)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from agentstream.infra.processes import free_port, wait_for_port
from agentstream.stack.broker import find_tansu, tansu_command


class MemoryBroker:
    """tansu with ``memory://`` storage on a free loopback port: a restart starts every topic again at offset 0."""

    def __init__(self, home: Path, host: str = "127.0.0.1") -> None:
        self.home, self.host = home, host
        self.port = free_port(host)
        self.binary = find_tansu(None, home)
        self.log_path = home / "tansu.log"
        self.process: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> MemoryBroker:
        command = tansu_command(self.binary, self.host, self.port)
        assert "memory://" in " ".join(command), f"the test needs an in-memory broker, got {command}"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_for_port(self.host, self.port, 10, self.process)
        return self

    def kill(self) -> None:
        """SIGKILL: everything it held is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self) -> MemoryBroker:
        self.kill()
        return self.start()


class PrivateBroker:
    """A tansu broker of this test only, on a fixed port, that can be killed, frozen and started again."""

    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self._command = tansu_command(find_tansu(None, home), "127.0.0.1", self.port)
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self._command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port("127.0.0.1", self.port, 10, self.process)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

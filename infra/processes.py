"""Background service processes that `agentstream up` starts and `down` stops, tracked by pidfile.

A pidfile records the PID together with the process start time read from ``/proc``, so
``down`` never signals an unrelated process that happens to reuse a PID.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from agentstream.schemas.errors import AgentstreamError

PORT_RELEASE_S = 5.0
"""How long `start` waits for a port whose last owner was just killed (its sockets are still closing)."""


class ServiceError(AgentstreamError, RuntimeError):
    """A service could not be started or stopped; the message is one line a user can act on."""


class PortInUse(ServiceError):
    """The port a service should listen on is already taken."""


@dataclass(frozen=True)
class ServiceRecord:
    """What a pidfile holds: enough to find, verify and describe a running service."""

    name: str
    pid: int
    start_ticks: int
    address: str
    command: list[str]
    log_path: str

    def alive(self) -> bool:
        return _start_ticks(self.pid) == self.start_ticks


def _start_ticks(pid: int) -> int | None:
    """The process start time in clock ticks since boot, or None if no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie is dead for our purposes
        return None
    return int(fields[19])


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None if it is gone (PID + start: one process)."""
    return _start_ticks(pid)


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_until_port_is_free(host: str, port: int, within_s: float = PORT_RELEASE_S,
                            after_crash: bool = False) -> bool:
    """Whether host:port can be bound, waiting up to ``within_s`` while nothing listens on it.

    A process killed a moment ago leaves its sockets closing for a few hundred milliseconds,
    during which the port cannot be bound; a port with a listener is taken, and answered at once,
    unless ``after_crash`` (the port's last owner died just now): a SIGKILLed JVM's listening socket
    still accepts for a moment after its main thread is gone, while its other threads exit.
    """
    deadline = time.monotonic() + within_s
    while not port_is_free(host, port):
        if time.monotonic() >= deadline or (not after_crash and _accepts_connections(host, port)):
            return False
        time.sleep(0.05)
    return True


LOWEST_FREE_PORT = 20000
"""Where :func:`free_port` starts looking; it stops below the kernel's ephemeral range."""

_handed_out: set[int] = set()
"""Ports :func:`free_port` returned in this process: each goes to one caller, who may bind it later."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (for tests and ephemeral stacks), below the ephemeral range.

    A port of the ephemeral range can be taken by any outgoing connection, or by a client that keeps
    dialing a stopped server there (a TCP socket then connects to itself), so a server restarted on
    it could find it held: a killed broker's port was, once, in `make test`. A port is handed out once per
    process, so two servers built before either binds get two ports (a fleet test once got one port twice).
    """
    below = _ephemeral_ports()[0]
    port = None
    if below - LOWEST_FREE_PORT >= 1000:
        for _ in range(200):
            candidate = random.randrange(LOWEST_FREE_PORT, below)
            if candidate not in _handed_out and port_is_free(host, candidate):
                port = candidate
                break
    while port is None or port in _handed_out:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
    _handed_out.add(port)
    return port


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def wait_for_port(host: str, port: int, timeout_s: float, process: subprocess.Popen | None = None,
                  log_path: Path | None = None) -> None:
    """Block until something accepts TCP connections on host:port, or raise ServiceError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServiceError(f"exited with status {process.returncode} while starting{_log_tail(log_path)}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ServiceError(f"did not open {host}:{port} within {timeout_s:.0f}s{_log_tail(log_path)}")


def _log_tail(log_path: Path | None) -> str:
    if log_path is None or not log_path.exists():
        return ""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return f"; last log line: {lines[-1].strip()}" if lines else ""


class ServiceDirectory:
    """The pidfiles and logs of the services one stack home runs."""

    def __init__(self, home: Path) -> None:
        self.run_dir = home / "run"
        self.log_dir = home / "logs"

    def record(self, name: str) -> ServiceRecord | None:
        path = self.run_dir / f"{name}.json"
        try:
            return ServiceRecord(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            path.unlink(missing_ok=True)
            return None

    def private_file(self, name: str, text: str) -> Path:
        """Write ``run/<name>`` readable by this user only (a service's configuration may hold secrets)."""
        path = self.run_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        return path

    def start(self, name: str, command: list[str], host: str, port: int, timeout_s: float = 30.0,
              env: dict[str, str] | None = None) -> ServiceRecord:
        """Start ``command`` detached, wait until it listens on host:port, and record it."""
        existing = self.record(name)
        if existing and existing.alive():
            return existing
        if not wait_until_port_is_free(host, port, after_crash=existing is not None):
            raise PortInUse(f"{name}: port {port} on {host} is already in use by another process; choose another port")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True, env=env,
            )
        try:
            wait_for_port(host, port, timeout_s, process, log_path)
        except ServiceError as error:
            _terminate(process.pid, timeout_s=5)
            raise ServiceError(f"{name} {error}") from None
        record = ServiceRecord(name, process.pid, _start_ticks(process.pid) or 0, f"{host}:{port}", command,
                               str(log_path))
        (self.run_dir / f"{name}.json").write_text(json.dumps(record.__dict__))
        return record

    def stop(self, name: str, timeout_s: float = 15.0) -> str:
        """Stop the service this directory started (and only it); returns what happened."""
        record = self.record(name)
        if record is None:
            return "not running"
        (self.run_dir / f"{name}.json").unlink(missing_ok=True)
        if not record.alive():
            return f"was not running (stale pidfile for pid {record.pid} removed)"
        forced = _terminate(record.pid, timeout_s)
        return f"stopped (pid {record.pid}{', killed after timeout' if forced else ''})"


def _terminate(pid: int, timeout_s: float) -> bool:
    """SIGTERM, wait, then SIGKILL; returns True if SIGKILL was needed."""
    ticks = _start_ticks(pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pid)
        if _start_ticks(pid) != ticks:
            return False
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    while _start_ticks(pid) == ticks:
        _reap(pid)
        time.sleep(0.02)
    return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass

"""`torchrun ... -m agentstream train-worker` as a process group of its own, with waits on its log."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


class Torchrun:
    """``python -m torch.distributed.run --standalone`` over ``-m agentstream ARGS``, in its own session."""

    def __init__(self, torchrun_args: list[str], args: list[str], env: dict, log_path: Path,
                 cwd: Path | None = None) -> None:
        self.command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *torchrun_args,
                        "-m", "agentstream", *args]
        self.env, self.log_path, self.cwd = env, log_path, cwd
        self.process: subprocess.Popen | None = None

    def start(self) -> Torchrun:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, env=self.env, cwd=self.cwd, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float = 90) -> re.Match:
        """The first match of ``pattern`` in the log; fails if the group exits or ``timeout_s`` passes first."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(pattern, self.log())):
            assert self.process.poll() is None, self.log()[-4000:]
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.log()[-4000:]}"
            time.sleep(0.1)
        return found

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM (rank 0 writes a last checkpoint, then stops the others); the whole group is killed after
        ``timeout_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

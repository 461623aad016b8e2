"""One active trainer per model on a machine; any other trainer of that model stands by, warm, to take over.

A restarted trainer spends most of its way back importing torch and transformers and building
the model (5-6 s of a 2-core machine, before it has read a record). A second trainer started
beside the first does all that at once and then waits on the model's lock file
(``<home>/trainers/<model>.lock``, an ``flock``): the kernel releases the lock the moment
the active process dies, however it dies, and the standby resumes from the latest
checkpoint and joins the group (about 2 s). The lock also keeps two trainers of one model on
one machine from splitting the topic's partitions between them and writing rival versions.
It is a lock on this machine's stack home: a standby on another machine is not fenced by it.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.05  # how often a standby tries the lock: a blocking flock would hold a thread past SIGTERM


class ModelLock:
    """The lock a trainer of ``model`` holds while it trains; ``take`` waits for it, standing by."""

    def __init__(self, home: Path, model: str) -> None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
        self.path = home / "trainers" / f"{safe}.lock"
        self.model = model
        self._handle: int | None = None

    @property
    def held(self) -> bool:
        return self._handle is not None

    def try_take(self) -> bool:
        """Take the lock if it is free; the lock file then names this process."""
        if self._handle is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(handle)
            return False
        os.ftruncate(handle, 0)
        os.pwrite(handle, str(os.getpid()).encode(), 0)
        self._handle = handle
        return True

    def holder(self) -> str:
        """The pid the lock file names (the active trainer), or '?' when it names none."""
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    async def take(self, stop: asyncio.Event, progress: Callable[[str], None]) -> bool:
        """Hold the lock, standing by while another trainer has it; False when ``stop`` is set first."""
        if self.try_take():
            return True
        active = self.holder()
        progress(f"trainer {self.model}: another trainer of {self.model} is active here (pid {active}, {self.path}); "
                 "standing by to take over when it exits")
        began = time.monotonic()
        while stop.is_set() or not self.try_take():
            try:
                await asyncio.wait_for(stop.wait(), POLL_S)
                return False
            except TimeoutError:
                pass
        progress(f"trainer {self.model}: taking over from pid {active} after {time.monotonic() - began:.1f} s "
                 "standing by")
        return True

    def release(self) -> None:
        if self._handle is not None:
            os.close(self._handle)  # closing the only descriptor drops the flock
            self._handle = None

"""Closes every running publisher at interpreter exit and on SIGTERM, so spans still in memory are not lost."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from typing import Protocol

log = logging.getLogger(__name__)


class Closable(Protocol):
    """What the hooks need of a publisher: a close() that flushes, then stops."""

    def close(self) -> None: ...


class _ExitHooks:
    """The running publishers, and the atexit and SIGTERM handlers that close them (installed on first use)."""

    def __init__(self) -> None:
        self._publishers: set[Closable] = set()
        self._lock = threading.Lock()
        self._atexit = False
        self._sigterm = False

    def add(self, publisher: Closable) -> None:
        with self._lock:
            self._publishers.add(publisher)
            if not self._atexit:
                atexit.register(self.close_all)
                self._atexit = True
            # Only where nobody else handles SIGTERM, and only the main thread may install handlers.
            if (not self._sigterm and threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
                signal.signal(signal.SIGTERM, self._on_sigterm)
                self._sigterm = True

    def discard(self, publisher: Closable) -> None:
        with self._lock:
            self._publishers.discard(publisher)

    def close_all(self) -> None:
        with self._lock:
            publishers = list(self._publishers)
        for publisher in publishers:
            publisher.close()

    def _on_sigterm(self, signum: int, frame: object) -> None:
        """Flush in a thread (the interrupted code may hold a publisher's lock), then die of SIGTERM as before."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        if self._publishers:
            log.warning("SIGTERM: flushing %d span publisher(s) before exiting", len(self._publishers))

        def flush_then_terminate() -> None:
            self.close_all()
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=flush_then_terminate, name="agentstream-sigterm").start()


_hooks = _ExitHooks()


def register(publisher: Closable) -> None:
    """Close `publisher` at interpreter exit and on SIGTERM (where the process has no SIGTERM handler of its own)."""
    _hooks.add(publisher)


def unregister(publisher: Closable) -> None:
    """Forget `publisher`: it is closed already."""
    _hooks.discard(publisher)

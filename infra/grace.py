"""A hard deadline on shutdown: once asked to stop, a process ends within its grace whatever it is waiting on.

A consumer that is stopping closes its Kafka clients, and aiokafka retries a broker that is
gone for as long as its own timeouts say (a stream worker SIGTERMed with the broker down logged
NodeNotReadyError and CancelledError tracebacks and was still running after 70 s). The
deadline is a daemon thread, so neither a blocked event loop nor a hung client delays it: when
the grace is over it logs one line saying what was abandoned and ends the process with
:data:`EXIT_ABANDONED`. Nothing acknowledged is lost by that: every consumer commits an offset
only after what it read was stored or trained, so the abandoned work is read again on restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("agentstream.shutdown")

EXIT_ABANDONED = 70  # EX_SOFTWARE: stopped by the deadline, not by a clean shutdown


class ShutdownDeadline:
    """Arm once on the first stop request; after ``grace_s`` the process exits, with a line from ``abandoned()``.

    ``abandoned`` describes the unfinished work (say, "3 rollouts in flight"); it runs on the
    deadline thread, so it must only read plain attributes.
    """

    def __init__(self, component: str, grace_s: float, abandoned: Callable[[], str] = lambda: "") -> None:
        self.component = component
        self.grace_s = grace_s
        self.abandoned = abandoned
        self._armed = threading.Event()
        self._done = threading.Event()

    @property
    def armed(self) -> bool:
        return self._armed.is_set()

    def arm(self) -> None:
        """Start the countdown (a second call does nothing: the first request sets the deadline)."""
        if self._armed.is_set():
            return
        self._armed.set()
        threading.Thread(target=self._expire, name=f"{self.component}-shutdown-deadline", daemon=True).start()

    def disarm(self) -> None:
        """The shutdown finished in time: the countdown ends without exiting."""
        self._done.set()

    def _expire(self) -> None:
        if self._done.wait(self.grace_s):
            return
        try:
            detail = self.abandoned()
        except Exception as error:  # the description is best effort; the exit is not
            detail = f"(could not describe it: {type(error).__name__})"
        log.error("%s did not stop within its shutdown grace of %.1f s; exiting now and abandoning %s; "
                  "offsets of unfinished work were not committed, so it is read again on restart",
                  self.component, self.grace_s, detail or "nothing in flight")
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_ABANDONED)


async def until_signalled(stop: asyncio.Event | None = None, deadline: ShutdownDeadline | None = None) -> None:
    """Wait for SIGTERM or SIGINT (then set ``stop``); a ``deadline`` is armed at the signal, not when stop is seen."""
    event = stop or asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        if deadline is not None:
            deadline.arm()
        event.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled)
    await event.wait()

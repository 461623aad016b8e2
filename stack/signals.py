"""How the embedded servers learn to stop: SIGTERM (``down``) or SIGINT (Ctrl-C) sets one event."""

from __future__ import annotations

import asyncio
import signal


def stop_on_signals() -> asyncio.Event:
    """An event the running loop sets on SIGTERM or SIGINT, so a server can close its sockets and files first."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop

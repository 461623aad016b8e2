"""An aiohttp application served on a free loopback port from a background thread (tests and benches)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop
from aiohttp import web

T = TypeVar("T")


class ServerThread:
    """An aiohttp app on a free loopback port, served by a uvloop loop in a background thread."""

    def __init__(self, app: web.Application):
        self.app = app
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(app, access_log=None)
        self.call(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.call(site.start())
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def stop(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def post(url: str, body: dict | bytes) -> tuple[int, dict | str, dict]:
    """POST raw JSON with urllib; returns (status, parsed body, headers) for errors too."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, raw, headers = response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as error:
        status, raw, headers = error.code, error.read().decode(), dict(error.headers)
    try:
        return status, json.loads(raw), headers
    except json.JSONDecodeError:
        return status, raw, headers

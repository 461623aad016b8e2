"""Hot swap: follow the compacted checkpoints topic and load every newer checkpoint of one model into a model server.

Full weights go to ``POST /v1/load_weights {"path", "version"}`` (the dev server's endpoint;
it waits for the generation in progress and serves everything after it with the new
weights). LoRA adapters go through vLLM's runtime LoRA contract: ``POST /v1/load_lora_adapter
{"lora_name": "<model>@v<version>", "lora_path", "version"}`` (vLLM needs
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``, and ignores ``version``), one
new name per version; older adapters are unloaded with ``/v1/unload_lora_adapter`` except the
newest ``keep_adapters``, so requests still naming the previous one finish. The server stamps
``X-Policy-Version`` on every response and the proxy records it on spans, so from the swap on
every span carries the new version. The sha256 in the Checkpoint event is checked before
loading whenever the weights file is readable here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiokafka import AIOKafkaConsumer

from infra.config import Config
from infra.kafka import client_options, topic_name
from models import WeightsError, local_path, verify_sha256
from schemas import CHECKPOINT, AvroCodec, CodecError
from schemas.contracts import policy_version

log = logging.getLogger("agentstream.hotswap")


class HotSwapError(RuntimeError):
    """A checkpoint cannot be loaded: its file does not match its sha256, or the server refused it."""


@dataclass(frozen=True)
class Swap:
    """One checkpoint loaded into the server: which, when it was written, and when the server had it."""

    model: str
    version: int
    format: str
    served_name: str
    created_at_us: int
    loaded_at_us: int


def adapter_name(model: str, version: int) -> str:
    """The LoRA name a version is served under: clients name it in ``model`` to get that version."""
    return f"{model}@v{version}"


class HotSwapper:
    """Loads each checkpoint of ``model`` newer than what the server has; ``run`` follows the topic until stopped."""

    def __init__(self, config: Config, bootstrap_servers: str, server_url: str, model: str, *,
                 verify: bool = True, keep_adapters: int = 2, on_swap: Callable[[Swap], None] | None = None,
                 retry_s: float = 0.5) -> None:
        self.config = config
        self.bootstrap_servers = bootstrap_servers
        self.server_url = server_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.verify = verify
        self.keep_adapters = keep_adapters
        self.on_swap = on_swap
        self.retry_s = retry_s
        self.version: int | None = None
        self.adapters: list[str] = []
        self.codec = AvroCodec()
        self._session: aiohttp.ClientSession | None = None

    async def run(self, stop: asyncio.Event) -> None:
        topic = topic_name(self.config.topics, "checkpoints")
        consumer = AIOKafkaConsumer(topic, **client_options(self.config.kafka, self.bootstrap_servers), group_id=None,
                                    enable_auto_commit=False, auto_offset_reset="earliest", fetch_max_wait_ms=50)
        await consumer.start()
        try:
            self.version = await self._server_version(stop)
            while not stop.is_set():
                fetched = await consumer.getmany(timeout_ms=100)
                newest = None
                for records in fetched.values():
                    for record in records:
                        checkpoint = self._decode(record)
                        if checkpoint and (newest is None or checkpoint["version"] > newest["version"]):
                            newest = checkpoint
                if newest is not None and (self.version is None or newest["version"] > self.version):
                    await self._apply_until_done(newest, stop)
        finally:
            await consumer.stop()
            await self.close()

    async def close(self) -> None:
        """Close the HTTP session (``run`` does it on the way out)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        return self._session

    def _decode(self, record) -> dict | None:
        if record.key != self.model.encode() or record.value is None:
            return None
        try:
            return self.codec.decode(record.value, CHECKPOINT)[1]
        except CodecError as error:
            log.error("skipped an unreadable checkpoint event at offset %d: %s", record.offset, error)
            return None

    async def _server_version(self, stop: asyncio.Event) -> int | None:
        """The version the server reports (X-Policy-Version on /health; None if it does not say), once it answers."""
        while not stop.is_set():
            try:
                async with self._http().get(f"{self.server_url}/health") as response:
                    return policy_version(response.headers)
            except aiohttp.ClientError:
                await asyncio.sleep(self.retry_s)
        return None

    async def _apply_until_done(self, checkpoint: dict, stop: asyncio.Event) -> None:
        """Apply one checkpoint, retrying while the server is unreachable; a refused one is logged and skipped."""
        while not stop.is_set():
            try:
                swap = await self.apply(checkpoint)
            except aiohttp.ClientConnectionError as error:
                log.warning("model server %s unreachable (%s); retrying", self.server_url, error)
                await asyncio.sleep(self.retry_s)
                continue
            except HotSwapError as error:
                log.error("checkpoint %s v%d not loaded: %s", checkpoint["model"], checkpoint["version"], error)
                return
            if self.on_swap is not None:
                self.on_swap(swap)
            return

    async def apply(self, checkpoint: dict) -> Swap:
        """Load one Checkpoint event's weights into the server."""
        folder = local_path(checkpoint["uri"])
        if self.verify:
            try:
                await asyncio.to_thread(verify_sha256, folder, checkpoint["format"], checkpoint["sha256"])
            except WeightsError as error:
                raise HotSwapError(str(error)) from error
        version = checkpoint["version"]
        if checkpoint["format"] == "lora":
            served = adapter_name(self.model, version)
            await self._post("/v1/load_lora_adapter", {"lora_name": served, "lora_path": str(folder),
                                                       "version": version}, tolerate="already been loaded")
            self.adapters.append(served)
            while len(self.adapters) > self.keep_adapters:
                await self._post("/v1/unload_lora_adapter", {"lora_name": self.adapters.pop(0)},
                                 tolerate="cannot be found")
        else:
            served = self.model
            await self._post("/v1/load_weights", {"path": str(folder), "version": version})
        self.version = version
        swap = Swap(self.model, version, checkpoint["format"], served, checkpoint["created_at_us"],
                    time.time_ns() // 1000)
        log.info("loaded %s v%d into %s as %s (%.3f s after it was written)", self.model, version, self.server_url,
                 served, (swap.loaded_at_us - swap.created_at_us) / 1e6)
        return swap

    async def _post(self, path: str, body: dict, tolerate: str | None = None) -> None:
        async with self._http().post(f"{self.server_url}{path}", json=body) as response:
            if response.status == 200:
                return
            text = await response.text()
            if tolerate is not None and tolerate in text:
                return
            raise HotSwapError(f"{path} answered HTTP {response.status}: {text[:300]}")

"""Hot swap: keep a model server holding the versions of one model that the deployments say it should serve.

It follows two topics: checkpoints (what versions exist, where their weights are) and
deployments (which versions serve, see ``deploy/deployments.py``). LoRA adapters go through
vLLM's runtime LoRA contract: ``POST /v1/load_lora_adapter {"lora_name": "<model>@v<version>",
"lora_path", "version"}`` (vLLM needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and
``--enable-lora``, and ignores ``version``), one name per version, unloaded with
``/v1/unload_lora_adapter`` once no route names it (the version serving before the current
stable one stays loaded, so requests routed just before a change finish). Full weights go to
the dev server's ``POST /v1/load_weights {"path", "version"}``, which waits for the generation
in progress. Both take a path on the server's disk: an ``s3://`` checkpoint is first downloaded
into this machine's checkpoint cache (``[checkpoints]``, every file's sha256 checked), and that
folder is what the server is given, so hot swap runs on the server's machine. The sha256 in the
Checkpoint event is checked before loading whenever the weights file is readable here, and so is
every weight: a checkpoint holding a NaN or an infinity is refused. A store that cannot be reached
is tried again, like a server that cannot.

The admin routes it calls take ``[security] admin_token``, which hot swap sends as
``Authorization: Bearer``; a 401 is logged and tried again at the next re-check, never taken as
a bad checkpoint. Every ``deploy.reconcile_s`` seconds it asks the server what it really holds
(``X-Policy-Version`` on ``/health`` for full weights, the adapters ``/v1/models`` lists with the
folder each was loaded from) and restores what the deployments say it should hold: a server
restarted on the same address, an adapter unloaded or replaced behind its back.

Without the gate (``deploy.gate = false``) hot swap also decides: each newer checkpoint is
loaded and then promoted to all traffic (a PROMOTED decision by ``hotswap``), so the proxy
routes to it only once the server holds it. With the gate, candidates, canaries and promotions
are the gate's decisions (or a person's); hot swap loads what they name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agentstream.deploy.checkpoint_follower import CheckpointFollower
from agentstream.deploy.deployments import (
    Action,
    Decision,
    DeploymentFollower,
    DeploymentLog,
    Routing,
    adapter_name,
    announce,
    decide,
    split_adapter_name,
)
from agentstream.infra.checkpoint_store import CheckpointError, CheckpointReader
from agentstream.infra.config import Config
from agentstream.infra.security import KeySet
from agentstream.models import WeightsError, local_path, verify_finite, verify_sha256
from agentstream.schemas.checkpoint import Checkpoint
from agentstream.schemas.contracts import policy_version
from agentstream.schemas.errors import AgentstreamError

log = logging.getLogger("agentstream.hotswap")

CHECK_TIMEOUT_S = 10.0
"""How long one question about what the server holds may take (a hung server must not stall hot swap)."""


class HotSwapError(AgentstreamError, RuntimeError):
    """A checkpoint cannot be loaded: its file does not match its sha256, holds a non-finite weight, or was refused."""


class StoreNotReachable(HotSwapError):
    """The checkpoint store did not answer (retriable): the version is tried again, not refused."""

    retriable = True


class AdminTokenRefused(HotSwapError):
    """The server answered 401 to an admin route: ``[security] admin_token`` is missing or not the server's."""


@dataclass(frozen=True)
class Swap:
    """One checkpoint loaded into the server: which, when it was written, and when the server had it."""

    model: str
    version: int
    format: str
    served_name: str
    created_at_us: int
    loaded_at_us: int


class HotSwapper:
    """Loads into (and unloads from) a server the versions of ``model`` its routing needs; ``run`` follows.

    ``deployments`` records the promotions hot swap makes when no gate runs (``config.deploy.gate``
    false); without one (tests of loading alone) nothing is recorded. ``promotions`` is shared by
    the hot swaps of one process, one per server of a fleet: the first to load a version promotes
    it, the others take that decision as theirs rather than record it again.
    """

    def __init__(self, config: Config, bootstrap_servers: str, server_url: str, model: str, *,
                 verify: bool = True, on_swap: Callable[[Swap], None] | None = None, retry_s: float = 0.5,
                 deployments: DeploymentLog | None = None, reader: CheckpointReader | None = None,
                 promotions: dict[int, Decision] | None = None) -> None:
        self.config = config
        self.reader = reader or CheckpointReader(config.checkpoints, config.stack.home)
        self.folders: dict[int, str] = {}  # version -> the local folder the server was given
        self.bootstrap_servers = bootstrap_servers
        self.server_url = server_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.verify = verify
        self.on_swap = on_swap
        self.retry_s = retry_s
        self.deployments = deployments
        self.promotions = promotions
        self.gated = config.deploy.gate
        self.version: int | None = None  # full weights: the version the server holds
        self.adapters: dict[int, str] = {}  # version -> adapter name loaded on the server
        self.checkpoint_follower = CheckpointFollower(config, bootstrap_servers, model)
        self.checkpoints = self.checkpoint_follower.checkpoints
        self.refused: set[int] = set()
        self.missing: set[int] = set()
        self.unauthorized: set[int] = set()  # versions a 401 stopped until the next re-check
        self._next_check = 0.0
        self.routing = Routing(model)
        self.previous_stable: int | None = None
        self._routing_at_us = 0
        self._session: aiohttp.ClientSession | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Follow and reconcile until ``stop``; an error is raised once the followers have stopped."""
        await announce(self.config, self.bootstrap_servers, self.model, "hotswap", gated=self.gated, stop=stop)
        follower = DeploymentFollower(self.config, self.bootstrap_servers, on_decision=self._follow)
        done = asyncio.Event()  # set on the way out, whatever the way: a follower left on ``stop`` would outlive it
        following = asyncio.create_task(follower.run(done))
        await self.checkpoint_follower.start()
        try:
            self.version = await self._server_version(stop)
            await self._loaded_adapters()
            while not stop.is_set():
                if following.done():  # the deployments topic refused us: raise it
                    await following
                await self.checkpoint_follower.poll(timeout_ms=100)
                if follower.ready.is_set():
                    await self._reconcile(stop)
        finally:
            done.set()
            await self.checkpoint_follower.stop()
            await following
            await self.close()

    async def close(self) -> None:
        """Close the HTTP session (``run`` does it on the way out)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                                  headers=_admin_headers(self.config))
        return self._session

    def _follow(self, decision: Decision) -> None:
        """Take a decision about this model as the routing in force (decisions arrive in order)."""
        if decision.model == self.model and decision.at_us >= self._routing_at_us:
            self._set_routing(decision.routing, decision.at_us)

    def _set_routing(self, routing: Routing, at_us: int) -> None:
        if routing.stable_version != self.routing.stable_version:
            self.previous_stable = self.routing.stable_version
        self.routing, self._routing_at_us = routing, at_us

    # -- reconciling the server with the routing

    async def _reconcile(self, stop: asyncio.Event) -> None:
        await self._check_server()
        if not self.gated:
            await self._promote_newest(stop)
        routing = self.routing
        if routing.format == "full":
            if routing.stable_version and routing.stable_version != self.version:
                await self._load_until_done(routing.stable_version, stop)
            return
        wanted = {v for v in routing.loaded_versions() if v}
        for version in sorted(wanted - set(self.adapters)):
            await self._load_until_done(version, stop)
        keep = wanted | {self.previous_stable}
        for version in sorted(set(self.adapters) - keep):
            await self._unload(version)

    async def _promote_newest(self, stop: asyncio.Event) -> None:
        """No gate: load the newest checkpoint, then make it the stable version of all traffic."""
        newest = max((v for v in self.checkpoints if v not in self.refused), default=None)
        if newest is None or newest <= self.routing.stable_version:
            return
        checkpoint = self.checkpoints[newest]
        if not await self._load_until_done(newest, stop):
            return
        latest = max(self.promotions, default=0) if self.promotions is not None else 0
        if self.promotions and latest >= newest:  # another server of this fleet promoted it, or a newer one, first
            decision = self.promotions[latest]
            self._set_routing(decision.routing, decision.at_us)
            return
        decision = decide(self.routing, newest, Action.PROMOTED, "hotswap",
                          "no gate (deploy.gate = false): promoted to all traffic once the server held it",
                          stable_version=newest, stable_uri=checkpoint.uri, format=checkpoint.format,
                          canary_version=None, canary_share=0.0, candidate_version=None)
        if self.promotions is not None:
            self.promotions[newest] = decision
        self._set_routing(decision.routing, decision.at_us)
        if self.deployments is not None:
            await self.deployments.record(decision)

    async def _load_until_done(self, version: int, stop: asyncio.Event) -> bool:
        """Load one version, retrying while the server is unreachable; False if it is unknown or refused."""
        if self._holds(version):
            return True
        if version in self.refused or version in self.unauthorized:
            return False
        checkpoint = self.checkpoints.get(version)
        if checkpoint is None:  # its event may still be on the way: the next round tries again
            if version not in self.missing:
                log.warning("%s v%d is routed but no checkpoint event names it yet", self.model, version)
                self.missing.add(version)
            return False
        while not stop.is_set():
            try:
                swap = await self.apply(checkpoint)
            except aiohttp.ClientConnectionError as error:
                log.warning("model server %s unreachable (%s); retrying", self.server_url, error)
                await asyncio.sleep(self.retry_s)
                continue
            except StoreNotReachable as error:
                log.warning("checkpoint %s v%d: %s; retrying", checkpoint.model, version, error)
                await asyncio.sleep(self.retry_s)
                continue
            except AdminTokenRefused as error:
                log.error("%s v%d not loaded: %s; set [security] admin_token to the model server's (retrying at the "
                          "next re-check)", checkpoint.model, version, error)
                self.unauthorized.add(version)
                return False
            except HotSwapError as error:
                log.error("checkpoint %s v%d not loaded: %s", checkpoint.model, version, error)
                self.refused.add(version)
                return False
            if self.on_swap is not None:
                self.on_swap(swap)
            return True
        return False

    def _holds(self, version: int) -> bool:
        checkpoint = self.checkpoints.get(version)
        return version in self.adapters or (self.version == version and checkpoint is not None
                                            and checkpoint.format == "full")

    async def apply(self, checkpoint: Checkpoint) -> Swap:
        """Load one checkpoint's weights into the server (from this machine's cache for an ``s3://`` checkpoint)."""
        with contextlib.ExitStack() as held:  # the cache evicts no folder the server is still reading
            try:
                folder = await asyncio.to_thread(held.enter_context, self.reader.holding(checkpoint.uri))
            except CheckpointError as error:
                raise (StoreNotReachable if error.retriable else HotSwapError)(str(error)) from error
            return await self._load(checkpoint, folder)

    async def _load(self, checkpoint: Checkpoint, folder: Path) -> Swap:
        if self.verify:
            try:
                await asyncio.to_thread(verify_sha256, folder, checkpoint.format, checkpoint.sha256)
                await asyncio.to_thread(verify_finite, folder, checkpoint.format)  # vLLM would serve a NaN
            except WeightsError as error:
                raise HotSwapError(str(error)) from error
        version = checkpoint.version
        if checkpoint.format == "lora":
            served = adapter_name(self.model, version)
            await self._post("/v1/load_lora_adapter", {"lora_name": served, "lora_path": str(folder),
                                                       "version": version, "load_inplace": True},
                             tolerate="already been loaded")
            self.adapters[version] = served
        else:
            served = self.model
            await self._post("/v1/load_weights", {"path": str(folder), "version": version})
            self.version = version
        self.folders[version] = str(folder)
        swap = Swap(self.model, version, checkpoint.format, served, checkpoint.created_at_us,
                    time.time_ns() // 1000)
        log.info("loaded %s v%d into %s as %s (%.3f s after it was written)", self.model, version, self.server_url,
                 served, (swap.loaded_at_us - swap.created_at_us) / 1e6)
        return swap

    async def _unload(self, version: int) -> None:
        try:
            await self._post("/v1/unload_lora_adapter", {"lora_name": self.adapters[version]},
                             tolerate="cannot be found")
        except (aiohttp.ClientError, HotSwapError) as error:
            log.warning("could not unload %s: %s (will retry)", self.adapters[version], error)
            return
        log.info("unloaded %s from %s", self.adapters.pop(version), self.server_url)

    # -- what the server really holds

    async def _check_server(self) -> None:
        """Every ``deploy.reconcile_s``: take what the server really holds as known, so this round restores the rest."""
        period = self.config.deploy.reconcile_s
        if not period or time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + period
        try:
            version, listed = await self._holdings()
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            log.warning("could not ask %s what it holds (%s); asking again in %g s", self.server_url,
                        str(error) or type(error).__name__, period)
            return
        self.unauthorized.clear()
        if version is not None and version != self.version:
            log.warning("%s holds weights v%d where hot swap loaded v%s (restarted, or loaded behind hot swap's "
                        "back)", self.server_url, version, self.version)
            self.version = version
        lost = sorted(set(self.adapters) - set(listed))
        if lost:
            log.warning("%s no longer holds %s (restarted, or unloaded behind hot swap's back): restoring those "
                        "still deployed", self.server_url, ", ".join(self.adapters[v] for v in lost))
        self.adapters = {v: name for v, (name, _) in listed.items()}
        wanted = set(self.routing.loaded_versions())
        for v, (name, root) in sorted(listed.items()):
            checkpoint = self.checkpoints.get(v)
            expected = self.folders.get(v) or (str(local_path(checkpoint.uri)) if checkpoint is not None
                                               and CheckpointReader.is_local(checkpoint.uri) else None)
            if checkpoint is None or not root or expected is None or root == expected:
                continue
            log.warning("%s serves %s from %s, not from its checkpoint %s (replaced behind hot swap's back): %s",
                        self.server_url, name, root, checkpoint.uri,
                        "reloading it" if v in wanted else "unloading it")
            if v in wanted:
                del self.adapters[v]
            else:
                await self._unload(v)

    async def _holdings(self) -> tuple[int | None, dict[int, tuple[str, str]]]:
        """The server's weights version (None: it names none) and this model's adapters, version -> (name, root)."""
        timeout = aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S)
        async with self._http().get(f"{self.server_url}/health", timeout=timeout) as response:
            response.raise_for_status()
            version = policy_version(response.headers)
        async with self._http().get(f"{self.server_url}/v1/models", timeout=timeout) as response:
            response.raise_for_status()
            listed: Any = await response.json(content_type=None)
        adapters: dict[int, tuple[str, str]] = {}
        for entry in (listed or {}).get("data") or ():
            model, adapter_version = split_adapter_name(str(entry.get("id", "")))
            if model == self.model and adapter_version is not None:
                adapters[adapter_version] = (entry["id"], str(entry.get("root") or ""))
        return version, adapters

    # -- what the server holds when we start

    async def _server_version(self, stop: asyncio.Event) -> int | None:
        """The version the server reports (X-Policy-Version on /health; None if it does not say), once it answers."""
        while not stop.is_set():
            try:
                async with self._http().get(f"{self.server_url}/health") as response:
                    return policy_version(response.headers)
            except aiohttp.ClientError:
                await asyncio.sleep(self.retry_s)
        return None

    async def _loaded_adapters(self) -> None:
        """The adapters of this model the server already lists (after a restart of hot swap)."""
        try:
            async with self._http().get(f"{self.server_url}/v1/models") as response:
                listed: Any = await response.json(content_type=None)
        except (aiohttp.ClientError, ValueError):
            return
        for entry in (listed or {}).get("data") or ():
            model, version = split_adapter_name(str(entry.get("id", "")))
            if model == self.model and version is not None:
                self.adapters[version] = entry["id"]

    async def _post(self, path: str, body: dict, tolerate: str | None = None) -> None:
        async with self._http().post(f"{self.server_url}{path}", json=body) as response:
            if response.status == 200:
                return
            text = await response.text()
            if tolerate is not None and tolerate in text:
                return
            if response.status == 401:
                raise AdminTokenRefused(f"{path} answered HTTP 401: {text[:300]}")
            raise HotSwapError(f"{path} answered HTTP {response.status}: {text[:300]}")


def _admin_headers(config: Config) -> dict[str, str]:
    """The header that carries ``[security] admin_token`` (its first key, where it lists several), if one is set."""
    first = KeySet(config.security.admin_token).client_key()
    return {"Authorization": f"Bearer {first}"} if first else {}

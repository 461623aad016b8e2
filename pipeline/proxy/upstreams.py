"""A fleet of model servers behind the proxy: least outstanding requests, health checks, ejection and return.

Each replica is an OpenAI-compatible model server (vLLM or ``agentstream serve-model``). The pool
picks, among the healthy replicas that hold the requested model, the one with the fewest
requests in flight (ties go round robin). Every ``interval_s`` it asks each replica ``GET
/health`` (vLLM's liveness route) and ``GET /v1/models`` (what it holds: the base model and each
loaded adapter, ``model@vN``), so version routing needs nothing beyond vLLM's own contract.
``eject_after`` consecutive failures (a health check, a connection error, a 5xx before the body)
take a replica out; the first health check that passes puts it back. When every replica is out,
all of them are tried again, as Envoy's panic mode does: refusing everything helps no one. The
proxy checks nothing when it has a single model server: everything goes there, as it always did.

A replica whose listing could not be read (vLLM with ``--api-key`` answers 401 to the pool,
which has no key) is taken to hold every model. A model no replica lists is looked up once more
at once before the request is refused, since hot swap announces a version only after loading it
and the periodic listing may be a few seconds old.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

from agentstream.deploy.deployments import Routing, adapter_name, split_adapter_name
from agentstream.schemas.contracts import policy_version

log = logging.getLogger("agentstream.upstreams")

RELIST_GAP_S = 0.2


def base_url(url: str) -> str:
    """A model server's URL without a trailing slash or ``/v1`` (both are how operators write it)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


@dataclass
class Replica:
    """One model server of the pool and what the pool knows of it."""

    url: str
    outstanding: int = 0
    healthy: bool = True
    failures: int = 0  # consecutive
    models: frozenset[str] | None = None  # what /v1/models listed at the last check; None: unknown
    version: int | None = None  # the X-Policy-Version of /health (dev server); None: it names none
    served: int = 0  # requests that got an answer from it
    failed: int = 0  # requests and checks that failed on it
    last_error: str | None = None
    ejected_at: float | None = None

    def holds(self, model: str | None, version: int | None = None) -> bool:
        if model is None or self.models is None:
            return True
        if model not in self.models:
            return False
        return version is None or self.version is None or self.version == version

    def describe(self) -> dict[str, object]:
        return {"url": self.url, "healthy": self.healthy, "outstanding": self.outstanding, "served": self.served,
                "failed": self.failed, "models": None if self.models is None else sorted(self.models),
                "version": self.version, "last_error": self.last_error}


@dataclass(frozen=True)
class HealthSettings:
    """How the pool checks its replicas (``[proxy]`` in the configuration)."""

    interval_s: float = 2.0
    timeout_s: float = 2.0
    eject_after: int = 3


@dataclass
class UpstreamPool:
    """The replicas and the choice among them; ``run`` keeps their health and listings fresh."""

    urls: Sequence[str]
    health: HealthSettings = field(default_factory=HealthSettings)
    replicas: list[Replica] = field(init=False)
    retries: int = field(default=0, init=False)  # requests retried on another replica before their first byte
    _turn: int = field(default=0, init=False)
    _relisting: asyncio.Future | None = field(default=None, init=False, repr=False)
    _relisted_at: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        urls = [base_url(url) for url in self.urls]
        if not urls:
            raise ValueError("a pool needs at least one model server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a model server is listed twice: {urls}")
        self.replicas = [Replica(url) for url in urls]

    def candidates(self, model: str | None, version: int | None = None,
                   exclude: Iterable[Replica] = ()) -> list[Replica]:
        """Replicas that may take a request for ``model``: healthy ones holding it, or all when none is healthy."""
        excluded = {id(replica) for replica in exclude}
        holding = [r for r in self.replicas if id(r) not in excluded and r.holds(model, version)]
        healthy = [r for r in holding if r.healthy]
        return healthy or holding

    def pick(self, model: str | None, version: int | None = None, exclude: Iterable[Replica] = ()) -> Replica | None:
        """The replica with the fewest requests in flight among the candidates (ties in turn); None if none."""
        candidates = self.candidates(model, version, exclude)
        if not candidates:
            return None
        fewest = min(r.outstanding for r in candidates)
        tied = [r for r in candidates if r.outstanding == fewest]
        self._turn += 1
        return tied[self._turn % len(tied)]

    @contextlib.contextmanager
    def busy(self, replica: Replica):
        """Count a request in flight on ``replica`` for as long as the block runs."""
        replica.outstanding += 1
        try:
            yield replica
        finally:
            replica.outstanding -= 1

    def succeeded(self, replica: Replica) -> None:
        replica.served += 1
        replica.failures = 0
        if not replica.healthy:  # it was tried with every replica out, and answered
            self._return(replica, "it answered a request")

    def failed(self, replica: Replica, reason: str) -> None:
        """One failure on ``replica``; the ``eject_after``-th in a row takes it out until a health check passes."""
        replica.failed += 1
        replica.failures += 1
        replica.last_error = reason
        if replica.healthy and replica.failures >= self.health.eject_after and len(self.replicas) > 1:
            replica.healthy = False
            replica.ejected_at = time.monotonic()
            log.warning("model server %s ejected after %d failures in a row: %s", replica.url, replica.failures,
                        reason)

    async def check(self, session: aiohttp.ClientSession, replica: Replica) -> bool:
        """One health check of ``replica``: /health answers 200, then its /v1/models listing (best effort)."""
        try:
            await self._health(session, replica)
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            self.failed(replica, f"health check: {error or type(error).__name__}")
            return False
        await self._listing(session, replica)
        replica.failures = 0
        if not replica.healthy:
            self._return(replica, "its health check passed")
        return True

    def _return(self, replica: Replica, why: str) -> None:
        replica.healthy, replica.ejected_at = True, None
        log.warning("model server %s is back: %s", replica.url, why)

    async def relist(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        """Read what ``replica`` holds now: the version /health names (full weights) and its /v1/models listing."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            await self._health(session, replica)
        await self._listing(session, replica)

    async def _health(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        async with session.get(f"{replica.url}/health",
                               timeout=aiohttp.ClientTimeout(total=self.health.timeout_s)) as answer:
            await answer.read()
            if answer.status != 200:
                raise aiohttp.ClientResponseError(answer.request_info, (), status=answer.status,
                                                  message=f"/health answered HTTP {answer.status}")
            replica.version = policy_version(answer.headers)

    async def _listing(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        """A listing refused (no key for vLLM's --api-key) is unknown; one cut short keeps the last one read."""
        try:
            async with session.get(f"{replica.url}/v1/models",
                                   timeout=aiohttp.ClientTimeout(total=self.health.timeout_s)) as answer:
                if answer.status != 200:
                    replica.models = None
                    return
                listed = (await answer.json(content_type=None)).get("data") or []
                replica.models = frozenset(str(entry["id"]) for entry in listed)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            log.debug("cannot read the models of %s: %s", replica.url, error)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, replica) for replica in self.replicas))

    async def relist_all(self, session: aiohttp.ClientSession) -> None:
        """Read every healthy replica's listing now; concurrent callers share one round, and rounds are
        at least ``RELIST_GAP_S`` apart (a client pinning a version no one holds does not drive the fleet)."""
        relisting = self._relisting
        if relisting is None or relisting.done():
            if time.monotonic() - self._relisted_at < RELIST_GAP_S:
                return
            self._relisted_at = time.monotonic()
            relisting = self._relisting = asyncio.ensure_future(asyncio.gather(
                *(self.relist(session, replica) for replica in self.replicas if replica.healthy)))
        await asyncio.shield(relisting)

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Check every replica each ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.health.interval_s)
            try:
                await self.check_all(session)
            except Exception:  # a bug in one round must not end the checks
                log.exception("health check round failed")

    def describe(self) -> list[dict[str, object]]:
        return [replica.describe() for replica in self.replicas]


async def survey(urls: Sequence[str], timeout_s: float = 5.0) -> list[Replica]:
    """Ask each server once what it holds; ``failures`` > 0: it did not answer."""
    pool = UpstreamPool(urls, HealthSettings(timeout_s=timeout_s))
    async with aiohttp.ClientSession() as session:
        await pool.check_all(session)
    return pool.replicas


def missing(replica: Replica, routing: Routing) -> list[str]:
    """The versions ``routing`` wants served that ``replica`` lacks, as it would list them (unknown: none)."""
    if routing.format == "full":
        stable = routing.stable_version
        return [] if replica.version is None or replica.version == stable else [f"{routing.model} v{stable}"]
    if replica.models is None:
        return []
    wanted = (adapter_name(routing.model, v) if v else routing.model for v in routing.loaded_versions())
    return [name for name in wanted if name not in replica.models]


def holdings_rows(replicas: Sequence[Replica], routings: Iterable[Routing], model: str | None) -> list[list[object]]:
    """``agentstream deployments``' rows of model servers: up, weights version, what each holds and lacks."""
    routings = [r for r in routings if model in (None, r.model)]
    rows: list[list[object]] = []
    for replica in replicas:
        holds = "?" if replica.models is None else ", ".join(
            sorted(m for m in replica.models if model in (None, split_adapter_name(m)[0])))
        lacks = [name for routing in routings for name in missing(replica, routing)]
        rows.append([replica.url, "no" if replica.failures else "yes",
                     "" if replica.version is None else replica.version, holds, ", ".join(lacks)])
    return rows

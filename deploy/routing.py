"""Which model server name a proxied request goes to: the version deployed for its model, a canary, or a pinned one.

A request names a model. When the deployments topic knows that model (it is trained), the
request goes to the version serving its rollout (:meth:`Routing.choose`: the canary share is
taken by rollout, so every call of one rollout sees one version); a client pins a version
with ``model@vN`` or the ``X-Agentstream-Version`` header, and a pinned version the server
does not hold is refused. On LoRA deployments the upstream name is the adapter's
(``model@vN``; ``v0`` is the base model); on full weights it is the model's own name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agentstream.deploy.deployments import Routing, adapter_name, split_adapter_name
from agentstream.schemas.contracts import VERSION_HEADER
from agentstream.schemas.errors import AgentstreamError


class RoutingTable(Protocol):
    """Where the proxy reads the routing of a model (a DeploymentFollower)."""

    def routing(self, model: str) -> Routing | None: ...

    async def current(self, model: str) -> None:
        """Until ``model``'s routing is the newest the deployments say (bounded: a table not read yet gives up)."""


class RouteError(AgentstreamError, ValueError):
    """A request's version pin cannot be served: malformed, or a version the server does not hold."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Route:
    """Where one request goes: the trained model's name, the name sent upstream, the version and why."""

    model: str
    upstream_model: str
    version: int | None
    reason: str  # "stable", "canary", "pinned" or "unrouted"


def resolve_route(table: RoutingTable | None, requested: object, pin: str | None, rollout_key: str) -> Route:
    """The route of a request for ``requested`` (the body's ``model``) with an optional version header ``pin``."""
    if not isinstance(requested, str):
        return Route(str(requested or ""), requested, None, "unrouted")  # type: ignore[arg-type]
    model, pinned = split_adapter_name(requested)
    if pin not in (None, ""):
        if not pin.removeprefix("v").isdigit():
            raise RouteError(f"{VERSION_HEADER} must be a version number like 7 or v7, got {pin!r}", 400)
        header_version = int(pin.removeprefix("v"))
        if pinned is not None and pinned != header_version:
            raise RouteError(f"the request pins {requested!r} but {VERSION_HEADER} says v{header_version}", 400)
        pinned = header_version
    routing = table.routing(model) if table is not None else None
    if routing is None:
        if pinned is None:
            return Route(model, requested, None, "unrouted")
        return Route(model, adapter_name(model, pinned) if pinned else model, pinned, "pinned")
    if pinned is not None:
        loaded = routing.loaded_versions()
        if pinned not in loaded:
            held = ", ".join(f"v{v}" for v in loaded)
            raise RouteError(f"version {pinned} of model `{model}` is not loaded on the model server "
                             f"(it holds {held}; serving: {routing.describe()})", 404)
        version, reason = pinned, "pinned"
    else:
        version, reason = routing.choose(rollout_key)
    upstream = model if version == 0 or routing.format == "full" else adapter_name(model, version)
    return Route(model, upstream, version, reason)

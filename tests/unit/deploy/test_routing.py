"""Routing: requests for a trained model go to its deployed version, pins are checked, other models pass through."""

from __future__ import annotations

import pytest

from agentstream.deploy.deployments import Routing
from agentstream.deploy.routing import RouteError, resolve_route


class Table:
    def __init__(self, *routes: Routing) -> None:
        self.routes = {r.model: r for r in routes}

    def routing(self, model: str) -> Routing | None:
        return self.routes.get(model)


def test_requests_for_a_trained_model_go_to_its_deployed_adapter_and_pins_are_checked():
    table = Table(Routing("m", stable_version=3, candidate_version=4))
    route = resolve_route(table, "m", None, "r1")
    assert (route.model, route.upstream_model, route.version, route.reason) == ("m", "m@v3", 3, "stable")
    assert resolve_route(table, "m@v4", None, "r1").upstream_model == "m@v4"  # the candidate may be pinned
    assert resolve_route(table, "m", "v0", "r1").upstream_model == "m"  # v0 is the base model's own name
    assert resolve_route(table, "m", "4", "r1").reason == "pinned"
    with pytest.raises(RouteError, match="version 2 of model `m` is not loaded") as refused:
        resolve_route(table, "m@v2", None, "r1")
    assert refused.value.status == 404
    with pytest.raises(RouteError, match="must be a version number") as malformed:
        resolve_route(table, "m", "latest", "r1")
    assert malformed.value.status == 400
    with pytest.raises(RouteError, match="pins 'm@v3'"):
        resolve_route(table, "m@v3", "4", "r1")


def test_models_without_deployments_pass_through_unchanged():
    route = resolve_route(Table(), "other", None, "r")
    assert (route.upstream_model, route.version, route.reason) == ("other", None, "unrouted")
    assert resolve_route(None, "other@v2", None, "r").version == 2
    assert resolve_route(Table(), None, None, "r").reason == "unrouted"

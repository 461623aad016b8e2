"""The pool's choice among model servers: least outstanding, ties in turn, what each holds, ejection."""

from __future__ import annotations

import pytest

from agentstream.deploy.deployments import Routing
from agentstream.pipeline.proxy.upstreams import HealthSettings, UpstreamPool, base_url, holdings_rows


def pool(count: int = 3, eject_after: int = 2) -> UpstreamPool:
    return UpstreamPool([f"http://s{i}:8000/v1/" for i in range(count)], HealthSettings(eject_after=eject_after))


def test_urls_are_written_without_v1_and_each_once():
    assert base_url("http://a:8000/v1/") == "http://a:8000"
    assert [r.url for r in pool(2).replicas] == ["http://s0:8000", "http://s1:8000"]
    with pytest.raises(ValueError, match="twice"):
        UpstreamPool(["http://a:8000", "http://a:8000/v1"])
    with pytest.raises(ValueError, match="at least one"):
        UpstreamPool([])


def test_the_fewest_outstanding_wins_and_ties_take_turns():
    fleet = pool()
    a, b, c = fleet.replicas
    a.outstanding, b.outstanding, c.outstanding = 2, 1, 1
    picked = [fleet.pick(None) for _ in range(4)]
    assert set(map(id, picked)) == {id(b), id(c)} and picked[0] is not picked[1]
    c.outstanding = 0
    assert fleet.pick(None) is c
    with fleet.busy(c):
        assert c.outstanding == 1
    assert c.outstanding == 0
    assert fleet.pick(None, exclude=[c]) is b


def test_only_replicas_listing_a_model_take_it_and_unknown_listings_take_all():
    fleet = pool()
    a, b, c = fleet.replicas
    a.models, b.models = frozenset({"tiny", "tiny@v1"}), frozenset({"tiny"})  # c's listing unknown
    assert {id(fleet.pick("tiny@v1")) for _ in range(4)} == {id(a), id(c)}
    c.models = frozenset({"tiny"})
    assert all(fleet.pick("tiny@v1") is a for _ in range(3))
    assert fleet.pick("tiny@v2") is None
    a.version, b.version, c.version = 0, 3, 0  # full weights: the server's one version counts
    assert all(fleet.pick("tiny", 3) is b for _ in range(3))


def test_failures_in_a_row_eject_and_a_success_between_them_resets():
    fleet = pool(2, eject_after=2)
    a, b = fleet.replicas
    fleet.failed(a, "refused")
    fleet.succeeded(a)
    fleet.failed(a, "refused")
    assert a.healthy
    fleet.failed(a, "refused")
    assert not a.healthy and a.last_error == "refused"
    assert all(fleet.pick(None) is b for _ in range(3))
    fleet.failed(b, "reset")
    fleet.failed(b, "reset")
    assert {id(fleet.pick(None)) for _ in range(4)} == {id(a), id(b)}, "none healthy: all are tried"
    fleet.succeeded(a)
    assert a.healthy and fleet.pick(None) is a, "one that answers while all are out is back"


def test_a_single_model_server_is_never_ejected():
    single = pool(1, eject_after=1)
    single.failed(single.replicas[0], "refused")
    assert single.replicas[0].healthy and single.pick(None) is single.replicas[0]


def test_the_deployments_view_says_what_each_server_holds_and_lacks():
    fleet = pool(3)
    a, b, c = fleet.replicas
    a.models, b.models = frozenset({"tiny", "tiny@v1", "tiny@v2", "other"}), frozenset({"tiny", "tiny@v1"})
    a.version = b.version = 0
    c.failures = 1  # did not answer: nothing known
    lora = Routing("tiny", stable_version=2, canary_version=1, canary_share=0.1)
    rows = holdings_rows(fleet.replicas, [lora], "tiny")
    assert rows == [["http://s0:8000", "yes", 0, "tiny, tiny@v1, tiny@v2", ""],
                    ["http://s1:8000", "yes", 0, "tiny, tiny@v1", "tiny@v2"],
                    ["http://s2:8000", "no", "", "?", ""]]
    b.version = 3
    assert holdings_rows([a, b], [Routing("tiny", stable_version=3, format="full")], None)[0][4] == "tiny v3"

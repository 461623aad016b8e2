"""The deployments log's pure parts: adapter names, canary shares, decisions as Avro events and rows, and
the disagreement between a gate and a hot swap that promotes by itself."""

from __future__ import annotations

from agentstream.deploy.deployments import (
    Action,
    Announcement,
    Decision,
    Routing,
    adapter_name,
    decide,
    disagreement,
    share_of,
    split_adapter_name,
)
from agentstream.schemas import ANNOUNCEMENT, DEPLOYMENT, AvroCodec


def test_adapter_names_round_trip_and_plain_names_have_no_version():
    assert split_adapter_name(adapter_name("org/model@x", 17)) == ("org/model@x", 17)
    assert split_adapter_name("smollm2") == ("smollm2", None)
    assert split_adapter_name("m@vx") == ("m@vx", None)


def test_the_canary_share_is_taken_by_rollout_and_is_stable():
    routing = Routing("m", stable_version=3, canary_version=5, canary_share=0.1)
    chosen = [routing.choose(f"rollout-{i}") for i in range(20_000)]
    canary = sum(reason == "canary" for _, reason in chosen)
    assert 0.09 < canary / len(chosen) < 0.11
    assert all(version == (5 if reason == "canary" else 3) for version, reason in chosen)
    assert [routing.choose(f"rollout-{i}") for i in range(200)] == chosen[:200]
    assert 0.0 <= share_of("anything") < 1.0


def test_full_weights_serve_only_the_stable_version():
    routing = Routing("m", stable_version=4, format="full", canary_version=5, canary_share=1.0)
    assert routing.loaded_versions() == [4]
    assert routing.choose("r") == (4, "stable")


def test_a_decision_is_an_avro_event_and_a_row():
    before = Routing("m", stable_version=2, stable_uri="file:///c/v2")
    decision = decide(before, 5, Action.CANARY, "gate", "passed", canary_version=5, canary_share=0.1,
                      candidate_score=0.8, stable_score=0.7, eval_tasks=32)
    assert decision.routing == Routing("m", 2, "file:///c/v2", "lora", 5, 0.1, None)
    codec = AvroCodec()
    assert Decision.from_record(codec.decode(codec.encode(DEPLOYMENT, decision.record()), DEPLOYMENT)[1]) == decision
    row = decision.row()
    assert row[:4] == [decision.decision_id, "m", 5, "CANARY"] and row[-1].timestamp() == decision.at_us / 1e6


# The bytes main (4837efc) wrote for these two events, before Announcement had record()/from_record() and
# Action had OTHER: the typed records must write the same bytes, and read the events already on the topic.
DECISION = Decision(version=5, action=Action.CANARY, decided_by="gate", reason="passed: 0.80 vs 0.70 on 32 tasks",
                    routing=Routing("m", stable_version=2, stable_uri="file:///c/v2", format="lora", canary_version=5,
                                    canary_share=0.1, candidate_version=None),
                    candidate_score=0.8, stable_score=0.7, eval_tasks=32, canary_reward=None, canary_rollouts=0,
                    stable_reward=0.5, stable_rollouts=12, at_us=1_764_000_000_123_456, decision_id="d" * 32)
DECISION_BYTES = bytes.fromhex(
    "00759d5ca2406464646464646464646464646464646464646464646464646464646464646464026d0a040867617465407061737365643a"
    "20302e383020767320302e3730206f6e203332207461736b73086c6f7261041866696c653a2f2f2f632f7632020a9a9999999999b93f00"
    "029a9999999999e93f02666666666666e63f40000002000000000000e03f188089a196a896a206")
ANNOUNCEMENT_RECORD = Announcement("m", "gate", True, "host:12:abcdef", 1_764_000_000_123_456, 20.0)
ANNOUNCEMENT_BYTES = bytes.fromhex(
    "0067f31d9c026d0867617465011c686f73743a31323a6162636465668089a196a896a2060000000000003440")


def test_deployment_events_keep_their_wire_bytes_and_old_events_still_read():
    codec = AvroCodec()
    assert codec.encode(DEPLOYMENT, DECISION.record()) == DECISION_BYTES
    assert Decision.from_record(codec.decode(DECISION_BYTES, DEPLOYMENT)[1]) == DECISION
    assert codec.encode(ANNOUNCEMENT, ANNOUNCEMENT_RECORD.record()) == ANNOUNCEMENT_BYTES
    assert Announcement.from_record(codec.decode(ANNOUNCEMENT_BYTES, ANNOUNCEMENT)[1]) == ANNOUNCEMENT_RECORD
    newer = {**DECISION.record(), "action": "OTHER"}  # what the reader schema makes of an action it does not know
    assert Decision.from_record(newer).action is Action.OTHER


def test_a_gate_and_a_hot_swap_that_promotes_by_itself_disagree():
    def said(role: str, gated: bool, instance: str, at_us: int = 1_000_000_000, live_s: float = 20.0):
        return Announcement("m", role, gated, instance, at_us, live_s)

    now = 1_000_000_000 + 5_000_000
    gate, promoting, gated_swap = said("gate", True, "g"), said("hotswap", False, "h"), said("hotswap", True, "h2")
    assert "deploy.gate = false" in disagreement(promoting, [gate], now)
    assert "restart hot swap with deploy.gate = true" in disagreement(gate, [promoting], now)
    assert disagreement(gated_swap, [gate], now) is None
    assert disagreement(promoting, [said("hotswap", False, "h3")], now) is None  # many servers, many hot swaps
    assert disagreement(promoting, [said("gate", True, "g", live_s=0.0)], now) is None  # withdrawn
    assert disagreement(promoting, [said("gate", True, "g", at_us=now - 30_000_000)], now) is None  # lapsed
    other_model = Announcement("other", "gate", True, "g", 1_000_000_000, 20.0)
    assert disagreement(promoting, [other_model], now) is None

"""Credit assignment and trajectory assembly on hand-built spans, with hand-checked numbers."""

from __future__ import annotations

import asyncio
import io
import struct
from dataclasses import replace

import fastavro
import pytest

from infra.config import CreditRule, load_config
from schemas import AvroCodec
from schemas.container_file import container_file
from streams.credit import DiscountedReturns, FinalReward, GroupNormalized, matching_rule
from streams.groups import GroupProcessor
from streams.lifecycle import RolloutTracker
from streams.records import RawRecord
from streams.sink import CompletionSink
from streams.trajectory import SpanNode, Trajectory, assemble


def node(span_id, kind, start, end=None, parent="", reward=None, attempt="a1", tokens=True, model="m"):
    return SpanNode(span_id=span_id, parent_id=parent, kind=kind, name=kind.lower(), start_us=start,
                    end_us=end if end is not None else start, attempt_id=attempt, agent_name="agent", model=model,
                    has_token_ids=tokens and kind == "LLM", reward=reward)


def trajectory():
    """root[0..100]: llm1@10, reward 1.0 @20, llm2@30, llm3@50, reward 2.0 @60, final reward 4.0 @90."""
    spans = [
        node("root", "AGENT", 0, 100),
        node("llm1", "LLM", 10, 15, "root"),
        node("r1", "REWARD", 20, parent="root", reward=1.0),
        node("llm2", "LLM", 30, 35, "root"),
        node("llm3", "LLM", 50, 55, "root"),
        node("r2", "REWARD", 60, parent="root", reward=2.0),
        node("r3", "REWARD", 90, parent="root", reward=4.0),
    ]
    return assemble("ro", spans, "SUCCEEDED", "a1")


def test_final_strategy_broadcasts_the_last_reward():
    credits = FinalReward().assign(trajectory())
    assert [(c.call.span_id, c.step_index, c.reward, c.advantage) for c in credits] == [
        ("llm1", 0, 4.0, 4.0), ("llm2", 1, 4.0, 4.0), ("llm3", 2, 4.0, 4.0)]


def test_discounted_strategy_honours_intermediate_rewards():
    credits = DiscountedReturns(gamma=0.5).assign(trajectory())
    # step rewards: llm1 gets r1 = 1; llm2 gets 0; llm3 gets r2 + r3 = 6
    # returns: G3 = 6, G2 = 0 + 0.5 * 6 = 3, G1 = 1 + 0.5 * 3 = 2.5
    assert [(c.reward, c.return_value, c.advantage) for c in credits] == [(1.0, 2.5, 2.5), (0.0, 3.0, 3.0),
                                                                          (6.0, 6.0, 6.0)]
    undiscounted = DiscountedReturns(gamma=1.0).assign(trajectory())
    assert [c.return_value for c in undiscounted] == [7.0, 6.0, 6.0]


def test_reward_before_the_first_call_goes_to_the_first_call():
    spans = [node("r0", "REWARD", 1, reward=0.5), node("llm", "LLM", 5, 6), node("llm2", "LLM", 8, 9)]
    credits = DiscountedReturns(gamma=1.0).assign(assemble("ro", spans, "SUCCEEDED", "a1"))
    assert [c.reward for c in credits] == [0.5, 0.0]


def test_grpo_normalises_within_the_group():
    members = []
    for index, reward in enumerate([1.0, 0.0, 0.0, 1.0]):
        spans = [node(f"llm{index}", "LLM", 1, 2), node(f"r{index}", "REWARD", 3, reward=reward)]
        members.append(assemble(f"ro{index}", spans, "SUCCEEDED", "a1"))
    credits = GroupNormalized(epsilon=0.0).assign_group(members)
    # mean 0.5, population std 0.5: advantages +1 / -1
    assert [credits[f"ro{i}"][0].advantage for i in range(4)] == [1.0, -1.0, -1.0, 1.0]
    same = [assemble(f"s{i}", [node(f"l{i}", "LLM", 1, 2), node(f"q{i}", "REWARD", 3, reward=1.0)], "SUCCEEDED", "a1")
            for i in range(3)]
    assert not GroupNormalized.informative([t.final_reward for t in same])
    assert all(c[0].advantage == 0.0 for c in GroupNormalized().assign_group(same).values())


def test_calls_without_token_ids_are_not_trainable():
    spans = [node("llm", "LLM", 1, 2, tokens=False), node("llm2", "LLM", 3, 4), node("r", "REWARD", 5, reward=1.0)]
    trajectory_ = assemble("ro", spans, "SUCCEEDED", "a1")
    assert [c.span_id for c in trajectory_.llm_calls] == ["llm", "llm2"]
    assert [c.call.span_id for c in FinalReward().assign(trajectory_)] == ["llm2"]


def test_orphans_are_reattached_by_time_envelope_and_attempts_are_separated():
    spans = [
        node("root", "AGENT", 0, 100), node("tool", "TOOL", 10, 40, "root"),
        node("orphan", "LLM", 20, 30, parent="missing-parent"),
        node("proxy-llm", "LLM", 50, 60),  # no parent at all: a root of its own
        node("old", "LLM", 0, 5, attempt="a0"),
    ]
    built = assemble("ro", spans, "SUCCEEDED", "a1")
    by_id = {s.span_id: s for s in built.spans}
    assert [c.span_id for c in by_id["tool"].children] == ["orphan"]
    assert sorted(r.span_id for r in built.roots) == ["proxy-llm", "root"]
    assert "old" not in by_id, "spans of another attempt are not part of this trajectory"
    assert assemble("ro", spans, "COMPLETED").attempt_id == "a1", "without a terminal event: the latest attempt"


def test_rules_select_agents_and_models_first_match_wins():
    rules = (CreditRule(agent="internal-*", train=False), CreditRule(agent="*", model="gpt-*", strategy="discounted"),
             CreditRule())
    assert not matching_rule(rules, "internal-tool", "x").train
    assert matching_rule(rules, "math", "gpt-4o").strategy == "discounted"
    assert matching_rule(rules, "math", "smollm").strategy == "final"
    assert matching_rule((CreditRule(agent="only"),), "other", "m") is None


def test_lifecycle_completes_on_end_event_plus_grace_or_idle_timeout():
    tracker = RolloutTracker(grace_s=1.0, idle_timeout_s=10.0)
    record = RawRecord("t", 0, 0, b"k", b"")
    assert tracker.on_event({"rollout_id": "a", "attempt_id": "a1", "event": "STARTED"}, record, 0.0) is True
    first, second = node("s1", "LLM", 10, 20), node("s2", "LLM", 20, 30)
    assert tracker.on_spans("a", record, 1.0, [first]) is False, "only the first record of a rollout is held"
    assert tracker.on_spans("b", record, 1.0, []) is True
    tracker.on_spans("a", record, 1.5, [second])
    tracker.on_event({"rollout_id": "a", "attempt_id": "a1", "event": "SUCCEEDED"}, record, 2.0)
    assert tracker.pop_due(2.5) == []
    done = tracker.pop_due(3.0)
    assert [r.rollout_id for r in done] == ["a"] and done[0].spans == [first, second]
    assert done[0].seen_from_start, "opened by its STARTED event: every span it has is in memory"
    assert tracker.pop_due(10.9) == []
    [late] = tracker.pop_due(11.0)
    assert late.rollout_id == "b" and not late.seen_from_start, "opened by a span: earlier ones may be missing"


def test_container_file_of_raw_bodies_reads_back():
    codec = AvroCodec()
    spans = [{"span_id": f"s{i}", "rollout_id": "r", "attempt_id": "a", "name": "n", "kind": "LLM",
              "start_time_us": i, "end_time_us": i + 1, "attributes": {"k": "v"}, "prompt_token_ids": [i, 2],
              "response_token_ids": [3], "response_logprobs": [-0.5]} for i in range(3)]
    records = [codec.encode_span_batch(spans[:2]), codec.encode_span_batch(spans[2:])]
    _, _, schema = codec.writer_schema(records[0])
    read = list(fastavro.reader(io.BytesIO(container_file(schema, [r[5:] for r in records]))))
    assert [s["span_id"] for batch in read for s in batch["spans"]] == ["s0", "s1", "s2"]
    assert read[1]["spans"][0]["prompt_token_ids"] == [2, 2]


@pytest.mark.parametrize("gamma", [0.0, 1.0])
def test_discount_edges(gamma):
    credits = DiscountedReturns(gamma).assign(trajectory())
    assert credits[0].return_value == (1.0 if gamma == 0.0 else 7.0)


def test_the_running_baseline_centres_online_rewards_per_agent():
    from streams.credit import RunningBaseline, strategy_for

    rule = CreditRule(strategy="baseline")
    assert strategy_for(rule) is strategy_for(rule)  # one stateful object per rule
    baseline = RunningBaseline(decay=0.5)

    def advantage(agent: str, reward: float) -> float:
        call = SpanNode("c", "", "LLM", "chat", 0, 1, "a", has_token_ids=True)
        rewarded = SpanNode("r", "", "REWARD", "reward", 2, 2, "a", reward=reward)
        trajectory = Trajectory("r", "a", "SUCCEEDED", agent, "", "", [call, rewarded], [call], [call], [rewarded])
        (credit,) = baseline.assign(trajectory)
        assert credit.reward == reward
        return credit.advantage

    assert advantage("x", 1.0) == 0.0  # the first reward sets the mean
    assert advantage("x", 0.0) == -1.0
    assert advantage("x", 1.0) == 0.5  # mean 0.5 after (1, 0)
    assert advantage("y", 0.0) == 0.0  # another agent has its own mean


class Sent:
    """Collects what a processor sends to Kafka (the Emitter protocol), for a test without a broker."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes | None, bytes]] = []

    async def send(self, topic, key, value, headers=None) -> None:
        self.records.append((topic, key, value))

    async def flush(self) -> None:
        pass


class Held:
    def hold(self, record) -> None:
        pass

    def release(self, record) -> None:
        pass


@pytest.mark.parametrize("keep_flat", [False, True])
def test_a_flat_group_is_dropped_or_kept_with_zero_advantage_as_its_rule_says(keep_flat):
    rule = CreditRule(agent="agent", strategy="grpo", group_size=2, keep_flat_groups=keep_flat)
    config = replace(load_config(environ={}), credit=(rule,))
    sink = CompletionSink(None, "db", Held())  # type: ignore[arg-type]  # queues completions; nothing stores them here
    processor = GroupProcessor(config, Sent(), Held(), sink, AvroCodec())  # type: ignore[arg-type]

    def result(group, rollout, reward):
        return RawRecord("groups", 0, 0, group.encode(), b""), {
            "rollout_id": rollout, "attempt_id": "a", "group_id": group, "agent_name": "agent", "status": "SUCCEEDED",
            "final_reward": reward, "completed_at_us": 1, "drafts": [{"model": "m", "head": rollout.encode()}]}

    processor.apply([result("flat", "f1", 1.0), result("flat", "f2", 1.0),
                     result("spread", "s1", 1.0), result("spread", "s2", 0.0)])
    asyncio.run(processor.tick())
    completion = sink.queue.get_nowait()
    credit = {datum[:2].decode(): struct.unpack("<ddd", datum[2:26])[2] for datum in completion.transitions}
    assert credit.pop("s1") == pytest.approx(1.0, abs=1e-5) and credit.pop("s2") == pytest.approx(-1.0, abs=1e-5)
    assert credit == ({"f1": 0.0, "f2": 0.0} if keep_flat else {})
    assert (processor.groups_credited, processor.groups_uninformative) == (1, 1)
    assert len(completion.release) == 2  # both groups' held records go, whether or not they trained

"""The group processor: a flat group is dropped or kept with zero advantage, as its rule says."""

from __future__ import annotations

import asyncio
import struct
from dataclasses import replace

import pytest

from agentstream.infra.config import CreditRule, load_config
from agentstream.schemas import AvroCodec
from agentstream.streams.groups import GroupProcessor
from agentstream.streams.records import RawRecord
from agentstream.streams.sink import CompletionSink
from tests.support.streams_fakes import Held, Sent


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

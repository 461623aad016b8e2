"""The stage publishes transitions keyed by model, with the rollouts each record carries."""

from __future__ import annotations

import asyncio
import random

from agentstream.infra.config import load_config
from agentstream.schemas import AvroCodec
from agentstream.schemas.span_reader import SpanReader
from agentstream.schemas.transition_writer import draft
from agentstream.streams.stage import Stage, Transitions
from agentstream.streams.trajectory import SpanNode
from tests.support.spans import random_span

CODEC = AvroCodec()


def test_transitions_are_published_by_model_with_the_rollouts_they_carry():
    class Emitter:
        def __init__(self) -> None:
            self.sent: list[tuple[str, bytes | None, bytes, list[tuple[str, bytes]] | None]] = []
            self.flushed = 0

        async def send(self, topic, key, value, headers=None) -> None:
            self.sent.append((topic, key, value, headers))

        async def flush(self) -> None:
            self.flushed += 1

    record = CODEC.encode_span_batch([random_span(random.Random(6), 0)])
    _, _, schema = CODEC.writer_schema(record)
    [node] = SpanReader(schema, SpanNode).batch(record[5:])
    transitions = Transitions()
    for rollout, model in [("r2", "m-b"), ("r1", "m-a"), ("r3", "m-b"), ("r2", "m-b")]:
        pending = draft(rollout, "a1", "agent", model, 0, node)
        transitions.drafts.append(pending)
        transitions.datums.append(pending.complete(1.0, 1.0, 0.5, None, 7))
    emitter = Emitter()
    # publishing needs neither a holder nor a sink
    stage = Stage(load_config(environ={}), emitter, holder=None, sink=None, codec=CODEC)  # type: ignore[arg-type]
    asyncio.run(stage.publish_transitions(transitions))
    asyncio.run(stage.publish_transitions(Transitions()))  # nothing to send: no record, no flush
    assert [(key, headers) for _, key, _, headers in emitter.sent] == [
        (b"m-a", [("agentstream-rollouts", b"r1")]), (b"m-b", [("agentstream-rollouts", b"r2,r3")])]
    assert {topic for topic, _, _, _ in emitter.sent} == {stage.transitions_topic}
    assert [[t["rollout_id"] for t in CODEC.decode(value)[1]["transitions"]] for _, _, value, _ in emitter.sent] == [
        ["r1"], ["r2", "r3", "r2"]]
    assert emitter.flushed == 1 and stage.counters.transitions == 4

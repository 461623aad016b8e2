"""Read what landed on a topic back from the real broker, decoded, for assertions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from agentstream.schemas import AvroCodec


@dataclass
class Landed:
    """Decoded records of the spans topic: spans and rollout events, in topic order per partition."""

    spans: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    records: int = 0

    def of(self, rollout_id: str) -> tuple[list[dict], list[dict]]:
        return ([s for s in self.spans if s["rollout_id"] == rollout_id],
                [e for e in self.events if e["rollout_id"] == rollout_id])


async def _read(options: dict, topic: str, done: Callable[[Landed], bool], timeout_s: float) -> Landed:
    codec = AvroCodec()
    consumer = AIOKafkaConsumer(**options, enable_auto_commit=False)
    await consumer.start()
    landed = Landed()
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        while not partitions:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not done(landed):
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    landed.records += 1
                    name, value = codec.decode(record.value)
                    if name.endswith("SpanBatch"):
                        landed.spans.extend(value["spans"])
                    elif name.endswith("Span"):
                        landed.spans.append(value)
                    elif name.endswith("RolloutEvent"):
                        landed.events.append(value)
    finally:
        await consumer.stop()
    return landed


def read_topic(options: dict, topic: str, done: Callable[[Landed], bool], timeout_s: float = 30.0) -> Landed:
    """Read ``topic`` from the beginning until ``done(landed)`` or the timeout."""
    return asyncio.run(_read(options, topic, done, timeout_s))

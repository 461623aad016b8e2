"""Load and read-back for tests and benches on the three-broker cluster: rollouts published at a steady pace
through a (ledgered) SpanPublisher, and the ids each record of a topic carries, to count what was written twice."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from aiokafka import AIOKafkaConsumer, TopicPartition

from agentstream.pipeline.publisher import SpanPublisher
from agentstream.schemas import SPAN_BATCH, TRANSITION, TRANSITION_BATCH, AvroCodec
from tests.support.kafka_cluster import KafkaCluster

CODEC = AvroCodec()
LLM_CALLS = 4
ROLLOUTS_PER_S = 8.0


def rollout_spans(rollout_id: str, model: str, reward: float) -> list[dict]:
    """LLM_CALLS LLM spans with token ids (one transition each under `final` credit) and a reward span."""
    now = time.time_ns() // 1000
    common = {"rollout_id": rollout_id, "attempt_id": f"{rollout_id}-1", "agent_name": "agent", "task_id": "task",
              "group_id": None, "attributes": {}, "status": "OK"}
    spans = [{**common, "span_id": f"{rollout_id}-llm{i}", "name": "chat", "kind": "LLM", "start_time_us": now + i,
              "end_time_us": now + i + 1, "model": model, "policy_version": 0, "prompt_token_ids": [60, 61, 62, i],
              "response_token_ids": [70, 71 + i], "response_logprobs": [-5.0, -5.5]} for i in range(LLM_CALLS)]
    return [*spans, {**common, "span_id": f"{rollout_id}-r", "name": "reward", "kind": "REWARD",
                     "start_time_us": now + 10, "end_time_us": now + 10, "reward": reward}]


class Load(threading.Thread):
    """Rollouts (STARTED, spans, SUCCEEDED) published at a steady pace; remembers when each one was handed over and
    how long the slowest publish call took (a publisher that blocks its caller is no back-pressure)."""

    def __init__(self, publisher: SpanPublisher, model: str, prefix: str, per_s: float = ROLLOUTS_PER_S) -> None:
        super().__init__(name="cluster-load", daemon=True)
        self.publisher, self.model, self.prefix, self.per_s = publisher, model, prefix, per_s
        self.published: list[tuple[str, float]] = []  # (rollout id, wall time it was handed to the publisher)
        self.slowest_call_s = 0.0
        self.stopping = threading.Event()

    def run(self) -> None:
        begin, sent = time.monotonic(), 0
        while not self.stopping.wait(max(0.0, begin + sent / self.per_s - time.monotonic())):
            sent += 1
            rollout_id = f"{self.prefix}-{sent:06d}"
            handed = time.time()
            event = {"rollout_id": rollout_id, "attempt_id": f"{rollout_id}-1", "task_id": "task",
                     "agent_name": "agent"}
            self.publisher.publish_event({**event, "event": "STARTED", "at_us": time.time_ns() // 1000})
            for span in rollout_spans(rollout_id, self.model, reward=0.5 + sent % 2 / 2):
                self.publisher.publish(span)
            self.publisher.publish_event({**event, "event": "SUCCEEDED", "at_us": time.time_ns() // 1000})
            self.slowest_call_s = max(self.slowest_call_s, time.time() - handed)
            self.published.append((rollout_id, handed))

    def finish(self) -> None:
        self.stopping.set()
        self.join(30)

    def first_after(self, moment: float) -> str:
        """The first rollout handed over after ``moment`` (ids sort in publishing order)."""
        return next(rollout_id for rollout_id, handed in self.published if handed > moment)


async def _read_all(options: dict, topic: str, partitions: list[int]) -> list[bytes]:
    """Every record value of ``topic``, from the beginning up to its end offsets now."""
    consumer = AIOKafkaConsumer(**options, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        values: list[bytes] = []
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                values += [record.value for record in records]
        return values
    finally:
        await consumer.stop()


def ids_on_topic(options: dict, cluster: KafkaCluster, topic: str) -> Counter[str]:
    """How many records of ``topic`` (spans or transitions) carry each span or transition id."""
    values = asyncio.run(_read_all(options, topic, sorted(cluster.partitions(topic))))
    counts: Counter[str] = Counter()
    for value in values:
        name, decoded = CODEC.decode(value)
        if name == SPAN_BATCH:
            counts.update(span["span_id"] for span in decoded["spans"])
        elif name == TRANSITION_BATCH:
            counts.update(item["transition_id"] for item in decoded["transitions"])
        elif name == TRANSITION:
            counts[decoded["transition_id"]] += 1
    return counts


def beyond_first(counts: Counter[str]) -> int:
    """Occurrences past the first of each id: what was written twice."""
    return sum(count - 1 for count in counts.values() if count > 1)


def busiest_leader(cluster: KafkaCluster, topic: str) -> int:
    """The node that leads the most partitions of ``topic``."""
    leaders = Counter(leader for leader, _isr in cluster.partitions(topic).values())
    return leaders.most_common(1)[0][0]


def first_ack_after(spans: dict[str, tuple], rollout_id: str) -> float:
    """When a chaos ledger (its ``spans``: span id -> (producer, rollout id, ..., acknowledged at)) first acknowledged
    a span of a rollout at or after ``rollout_id`` (ids sort in order). ``spans`` is a
    :class:`~tests.support.span_ledger.LedgerState`'s, or any mapping of that shape."""
    return min(at for _producer, rollout, *_rest, at in spans.values() if rollout >= rollout_id)

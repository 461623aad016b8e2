"""What the dashboard reads from Kafka rather than ClickHouse: consumer lag per group and the dead letters.

Lag is a group's committed offset against the partition's high watermark. The high watermark
comes from a Fetch response, as in :func:`agentstream.infra.kafka.message_counts`: tansu can answer
ListOffsets(latest) too low. Nothing here joins a group or commits: the consumer is assigned
partitions by hand and only reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from agentstream.infra.config import Config
from agentstream.infra.kafka import client_options, product_topics, topic_name
from agentstream.schemas import DEAD_LETTER, AvroCodec, CodecError

LATEST_DEAD_LETTERS = 10


@dataclass
class KafkaState:
    """Lag rows (group, topic, partitions, committed, end, lag), the DLQ's size and its latest letters."""

    lag: list[list[Any]] = field(default_factory=list)
    dlq_count: int = 0
    dead_letters: list[list[Any]] = field(default_factory=list)
    elapsed_ms: float = 0.0
    error: str = ""


LAG_COLUMNS = ("group", "topic", "partitions", "committed", "log_end", "lag")
DEAD_LETTER_COLUMNS = ("at", "source_topic", "partition", "offset", "error_type", "error")


class KafkaReader:
    """Reads lag and dead letters on demand, refreshing its cached answer after ``ttl_s`` (pages poll every 5 s)."""

    def __init__(self, config: Config, bootstrap_servers: str, *, ttl_s: float = 3.0) -> None:
        self.config = config
        self.options = {**client_options(config.kafka, bootstrap_servers), "request_timeout_ms": 5000}
        self.dlq_topic = topic_name(config.topics, "dlq")
        self.ttl_s = ttl_s
        self._cached: tuple[float, KafkaState] | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._codec = AvroCodec()

    async def state(self) -> KafkaState:
        """The latest state: the first call waits for it; later ones get the cached one at once and, when it is
        older than ``ttl_s``, start a refresh in the background (a page never waits on the broker twice)."""
        if self._cached is None:
            await self.refresh()
        elif time.monotonic() - self._cached[0] >= self.ttl_s and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self.refresh())
        assert self._cached is not None
        return self._cached[1]

    async def refresh(self) -> None:
        """Read the broker now; a failure is kept in the state's ``error``, not raised."""
        async with self._lock:
            started = time.perf_counter()
            try:
                state = await asyncio.wait_for(self._read(), timeout=10)
            except (TimeoutError, Exception) as error:  # any broker failure: show it on the page
                state = KafkaState(error=f"{type(error).__name__}: {error}")
            state.elapsed_ms = (time.perf_counter() - started) * 1000
            self._cached = (time.monotonic(), state)

    async def close(self) -> None:
        """Stop a refresh in flight."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _read(self) -> KafkaState:
        admin = AIOKafkaAdminClient(**self.options)
        consumer = AIOKafkaConsumer(**self.options, enable_auto_commit=False, fetch_max_bytes=1 << 20,
                                    max_partition_fetch_bytes=1 << 18,
                                    fetch_max_wait_ms=50)  # tansu holds a fetch for the full wait
        await admin.start()
        await consumer.start()
        try:
            groups = sorted(group_id for group_id, _protocol in await admin.list_consumer_groups())
            await consumer._client.force_metadata_update()
            ours = [TopicPartition(spec.name, p) for spec in product_topics(self.config.topics)
                    for p in sorted(consumer.partitions_for_topic(spec.name) or ())]
            committed = {group_id: await self._committed(group_id, ours) for group_id in groups}
            dlq_tps = [tp for tp in ours if tp.topic == self.dlq_topic]
            tps = sorted({tp for offsets in committed.values() for tp in offsets} | set(dlq_tps))
            ends, starts = await self._watermarks(consumer, tps)
            state = KafkaState()
            for group_id, offsets in committed.items():
                by_topic: dict[str, list[int]] = {}
                for tp, offset in offsets.items():
                    row = by_topic.setdefault(tp.topic, [0, 0, 0, 0])
                    end = ends.get(tp, offset)
                    row[0] += 1
                    row[1] += offset
                    row[2] += end
                    row[3] += max(0, end - offset)
                state.lag.extend([group_id, topic, *numbers] for topic, numbers in sorted(by_topic.items()))
            state.dlq_count = sum(max(0, ends.get(tp, 0) - starts.get(tp, 0)) for tp in dlq_tps)
            state.dead_letters = await self._latest_letters(consumer, dlq_tps, starts, ends)
            return state
        finally:
            await consumer.stop()
            await admin.close()

    async def _committed(self, group_id: str, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """A group's committed offsets on this deployment's topics (OffsetFetch through a consumer that never joins).

        aiokafka's admin ``list_consumer_group_offsets`` cannot parse tansu's answer; the consumer's
        ``committed`` can. The consumer is not subscribed, so it never joins or rebalances the group.
        """
        consumer = AIOKafkaConsumer(**self.options, group_id=group_id, enable_auto_commit=False)
        await consumer.start()
        try:
            offsets = {tp: await consumer.committed(tp) for tp in tps}
        finally:
            await consumer.stop()
        return {tp: offset for tp, offset in offsets.items() if offset is not None and offset >= 0}

    async def _watermarks(self, consumer: AIOKafkaConsumer, tps: list[TopicPartition]
                          ) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
        if not tps:
            return {}, {}
        consumer.assign(tps)
        starts = await consumer.beginning_offsets(tps)
        listed = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, listed[tp])
        await consumer.getmany(timeout_ms=300)
        ends = {tp: max(consumer.highwater(tp) or 0, listed[tp]) for tp in tps}
        return ends, starts

    async def _latest_letters(self, consumer: AIOKafkaConsumer, tps: list[TopicPartition],
                              starts: dict[TopicPartition, int], ends: dict[TopicPartition, int]) -> list[list[Any]]:
        wanted = {tp: max(starts.get(tp, 0), ends.get(tp, 0) - LATEST_DEAD_LETTERS) for tp in tps
                  if ends.get(tp, 0) > starts.get(tp, 0)}
        if not wanted:
            return []
        consumer.assign(list(wanted))
        for tp, offset in wanted.items():
            consumer.seek(tp, offset)
        letters: list[list[Any]] = []
        deadline = time.monotonic() + 2.0
        remaining = {tp: ends[tp] for tp in wanted}
        while remaining and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=300)
            for tp, records in batches.items():
                for record in records:
                    letters.append(self._letter(record))
                if tp in remaining and consumer.highwater(tp) is not None and (await consumer.position(tp)) >= ends[tp]:
                    remaining.pop(tp)
            if not batches:
                break
        letters.sort(key=lambda row: row[0], reverse=True)
        return letters[:LATEST_DEAD_LETTERS]

    def _letter(self, record: Any) -> list[Any]:
        try:
            _, value = self._codec.decode(record.value, DEAD_LETTER)
        except CodecError as error:
            return [record.timestamp / 1000, self.dlq_topic, record.partition, record.offset, "unreadable", str(error)]
        return [value["at_us"] / 1e6, value["source_topic"], value["partition"], value["offset"],
                value["error_type"], value["error"][:500]]

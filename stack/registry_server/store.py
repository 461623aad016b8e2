"""Where a registry's log lives: a compacted single-partition Kafka topic (like Confluent's ``_schemas``), or memory.

A log is read from its beginning at start and tailed for as long as the registry runs, so
several registries on one topic converge. :meth:`KafkaLog.append` returns once the record has
come back through the reader and been applied, so a registry answers a write only when a read
would show it. At start a NOOP marker is written and awaited the same way: reading up to it
means the state holds every record written before (the high watermark tansu reports through
ListOffsets can be too low, so it is not used).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from agentstream.infra.config import KafkaConfig
from agentstream.infra.kafka import KafkaSetupError, TopicSpec, ensure_topics, start_producer, topic_partitions
from agentstream.infra.registry_client.errors import StoreError, StoreTimeout
from agentstream.stack.registry_server.state import NOOP_KEY, LogKey, LogValue

log = logging.getLogger("agentstream.schema_registry")

Apply = Callable[[LogKey | None, LogValue], None]


class SchemaLog(Protocol):
    """An append-only log of registry records, applied in order to a state through ``apply``."""

    async def start(self, apply: Apply) -> None:
        """Replay the log into ``apply`` and keep applying what is appended (by anyone) from then on."""
        ...

    async def append(self, key: LogKey, value: LogValue) -> None:
        """Write one record; return when it has been applied."""
        ...

    async def stop(self) -> None: ...


class MemoryLog:
    """A log in memory: for tests and throwaway registries; gone when the process ends."""

    def __init__(self) -> None:
        self._apply: Apply | None = None

    async def start(self, apply: Apply) -> None:
        self._apply = apply

    async def append(self, key: LogKey, value: LogValue) -> None:
        if self._apply is None:
            raise StoreError("the in-memory log is not started")
        self._apply(key, value)

    async def stop(self) -> None:
        self._apply = None


def _encode(document: dict[str, Any] | None) -> bytes | None:
    return None if document is None else json.dumps(document, separators=(",", ":"), sort_keys=True).encode()


def _decode(data: bytes | None) -> Any:
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


class KafkaLog:
    """The log as a compacted, single-partition Kafka topic, created when missing."""

    def __init__(self, kafka: KafkaConfig, client_options: dict[str, Any], topic: str, replication_factor: int = 1,
                 timeout_s: float = 30.0) -> None:
        self.kafka, self.options = kafka, client_options
        self.topic = topic
        self.replication_factor = replication_factor
        self.timeout_s = timeout_s
        self._partition = TopicPartition(topic, 0)
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._applied = 0  # offset of the next record to apply
        self._progress = asyncio.Condition()
        self._failure: BaseException | None = None
        self._apply: Apply | None = None

    async def start(self, apply: Apply) -> None:
        self._apply = apply
        await self._ensure_topic()
        self._producer = await start_producer(self.kafka, self.options, linger_ms=0)
        self._consumer = AIOKafkaConsumer(**self.options, enable_auto_commit=False, group_id=None,
                                          fetch_max_wait_ms=50, auto_offset_reset="earliest")
        await self._consumer.start()
        self._consumer.assign([self._partition])
        await self._consumer.seek_to_beginning(self._partition)
        self._reader = asyncio.create_task(self._read(), name=f"schema-log-reader {self.topic}")
        await self.append(NOOP_KEY, None)  # caught up once our own marker is read back

    async def _ensure_topic(self) -> None:
        admin = AIOKafkaAdminClient(**self.options)
        await admin.start()
        try:
            spec = TopicSpec("schemas", self.topic, 1, {"cleanup.policy": "compact"})
            await ensure_topics(admin, [spec], self.replication_factor)
            partitions = (await topic_partitions(admin, [self.topic])).get(self.topic)
        finally:
            await admin.close()
        if partitions != 1:
            raise KafkaSetupError(f"the schema registry topic {self.topic} has {partitions} partitions; it needs "
                                  f"exactly 1 so every registry reads the records in one order")

    async def _read(self) -> None:
        assert self._consumer is not None and self._apply is not None
        try:
            while True:
                batches = await self._consumer.getmany(self._partition, timeout_ms=500)
                records = batches.get(self._partition, [])
                for record in records:
                    try:
                        self._apply(_decode(record.key), _decode(record.value))
                    except Exception as error:  # a record another tool wrote badly must not stop the registry
                        log.warning("skipped schema log record at offset %d: %r", record.offset, error)
                if records:
                    async with self._progress:
                        self._applied = records[-1].offset + 1
                        self._progress.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            log.error("schema log reader stopped: %r", error)
            async with self._progress:
                self._failure = error
                self._progress.notify_all()
            raise

    async def append(self, key: LogKey, value: LogValue) -> None:
        if self._producer is None:
            raise StoreError("the schema log is not started")
        try:
            metadata = await asyncio.wait_for(
                self._producer.send_and_wait(self.topic, _encode(value), _encode(key), partition=0), self.timeout_s)
        except TimeoutError:
            raise StoreTimeout(f"writing to {self.topic} took longer than {self.timeout_s:.0f}s") from None
        except Exception as error:
            raise StoreError(f"could not write to {self.topic}: {error!r}") from error
        try:
            async with self._progress:
                await asyncio.wait_for(self._progress.wait_for(
                    lambda: self._applied > metadata.offset or self._failure is not None), self.timeout_s)
        except TimeoutError:
            raise StoreTimeout(f"offset {metadata.offset} of {self.topic} was not read back within "
                               f"{self.timeout_s:.0f}s") from None
        if self._failure is not None:
            raise StoreError(f"the reader of {self.topic} failed: {self._failure!r}")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        for client in (self._consumer, self._producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()
        self._reader = self._consumer = self._producer = None

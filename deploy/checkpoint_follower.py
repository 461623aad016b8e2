"""The checkpoints topic, followed: every Checkpoint event of one model, from the topic's start.

The topic is compacted and keyed by model, so reading it from the start gives each model's
checkpoints that are still announced. The gate and hot swap each keep one
:class:`CheckpointFollower`; an event that does not decode is skipped with its reason logged
(the topic has no dead-letter path: the next event of the model supersedes it).
"""

from __future__ import annotations

import logging
from typing import Any

from aiokafka import AIOKafkaConsumer

from agentstream.infra.config import Config
from agentstream.infra.kafka import check_topic_access, consumer_options, named_refusals, topic_name
from agentstream.schemas import CHECKPOINT, AvroCodec, CodecError
from agentstream.schemas.checkpoint import Checkpoint

log = logging.getLogger("agentstream.deployments")


def checkpoint_of(record: Any, model: str, codec: AvroCodec) -> Checkpoint | None:
    """The Checkpoint a checkpoints-topic record holds for ``model`` (None: another model's, or unreadable)."""
    if record.key != model.encode() or record.value is None:
        return None
    try:
        return Checkpoint.from_record(codec.decode(record.value, CHECKPOINT)[1])
    except CodecError as error:
        log.error("skipped an unreadable checkpoint event at offset %d: %s", record.offset, error)
        return None


class CheckpointFollower:
    """Reads the checkpoints topic from its start into ``checkpoints`` (version -> Checkpoint) for one model.

    ``start`` it, then call :meth:`poll` as often as the caller's loop turns; ``stop`` it at the end.
    ``checkpoints`` is one dict for the follower's life, so a caller may keep a reference to it.
    """

    def __init__(self, config: Config, bootstrap_servers: str, model: str) -> None:
        self.config = config
        self.bootstrap_servers = bootstrap_servers
        self.model = model
        self.topic = topic_name(config.topics, "checkpoints")
        self.checkpoints: dict[int, Checkpoint] = {}
        self.codec = AvroCodec()
        self._consumer: AIOKafkaConsumer | None = None
        self._options = consumer_options(config.kafka, bootstrap_servers)

    async def start(self) -> None:
        """Start reading; a refusal by the cluster (login, ACL on the topic) raises KafkaAccessDenied or
        KafkaAuthenticationFailed."""
        options = self._options
        self._consumer = AIOKafkaConsumer(self.topic, **options, group_id=None, enable_auto_commit=False,
                                          auto_offset_reset="earliest")
        async with named_refusals(options, f"reading {self.topic}"):
            await check_topic_access(options, [self.topic], f"reading {self.topic}")
            await self._consumer.start()

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def poll(self, timeout_ms: int) -> int:
        """Take what one fetch brings (waiting up to ``timeout_ms``); returns how many records it read, any model's."""
        assert self._consumer is not None, "start the follower first"
        read = 0
        async with named_refusals(self._options, f"reading {self.topic}"):  # Fetch refused: Read is not granted
            fetched = await self._consumer.getmany(timeout_ms=timeout_ms)
        for records in fetched.values():
            for record in records:
                read += 1
                checkpoint = checkpoint_of(record, self.model, self.codec)
                if checkpoint is not None:
                    self.checkpoints[checkpoint.version] = checkpoint
        return read

    async def catch_up(self, timeout_ms: int = 500) -> None:
        """Read until a fetch of ``timeout_ms`` brings nothing: the checkpoints that exist now."""
        while await self.poll(timeout_ms):
            pass

"""What every stream processor shares: the Kafka Streams shape, its outputs, its offset holder, its counters.

A processor (a :class:`Stage`) is a function from its input topic(s) to its output topics
and tables, with its state kept explicitly on the object:

    input topic ─► read(records) ─► apply(batch) ─► state ─► tick() ─► output topics (emitter)
                         └──────► ingest(batches) ─► ClickHouse          └─► ClickHouse (sink)

``read`` decodes a batch of records and leaves the state alone; ``apply`` takes a read batch into
the state (under the lock that ticks share); ``ingest`` stores what a batch itself carries
(outside the lock, on a task of its own); ``tick`` is the punctuator: it fires on a timer and
emits what the state says is complete. A record that state still depends on is *held* (its
offset is not committed) until what it led to is written, so a crash replays it.

The worker (:mod:`agentstream.streams.app`) wires each processor to its topics; the processors are
:class:`agentstream.streams.processor.SpanProcessor` (spans → spans, rollouts, transitions tables;
transitions, groups, dlq topics) and :class:`agentstream.streams.groups.GroupProcessor` (groups →
transitions topic and table).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from agentstream.infra.config import Config
from agentstream.infra.kafka import topic_name
from agentstream.schemas import AvroCodec
from agentstream.schemas.transition_writer import Draft, batch_records
from agentstream.streams.records import RawRecord
from agentstream.streams.sink import CompletionSink

Batch = TypeVar("Batch")
"""What a stage's ``read`` makes of a batch of records, for its ``apply`` and ``ingest``."""


class Emitter(Protocol):
    """Where output records go (a Kafka producer): send buffers, flush waits for the acknowledgements."""

    async def send(self, topic: str, key: bytes | None, value: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> None: ...

    async def flush(self) -> None: ...


class Holder(Protocol):
    """Keeps a record's offset from being committed until released (the framework's ack)."""

    def hold(self, record: RawRecord) -> None: ...

    def release(self, record: RawRecord) -> None: ...


@dataclass
class Counters:
    """What the processor has done, for status lines, tests and benchmarks."""

    records: int = 0
    spans_records: int = 0
    events: int = 0
    dead_letters: int = 0
    rollouts_completed: int = 0
    rollouts_awaiting_reward: int = 0
    rollouts_expired: int = 0
    rollouts_not_selected: int = 0
    rollouts_read_back: int = 0  # assembled from ClickHouse (not seen from their start, or a late reward)
    transitions: int = 0
    calls_without_tokens: int = 0
    group_results: int = 0
    credits_refused: int = 0  # rollouts (or group members) whose reward, return or advantage was not finite
    prefix_merges: int = 0  # trajectory level: calls merged into the sample before them
    prefix_breaks: int = 0  # trajectory level: samples split where the token prefix broke


@dataclass(slots=True)
class Transitions:
    """Credited transitions, in step: each one's draft (the model it trains, its rollout) and its Transition datum.

    Two lists rather than an object per transition: thousands are made per second.
    """

    drafts: list[Draft] = field(default_factory=list)
    datums: list[bytes] = field(default_factory=list)


def now_us() -> int:
    return time.time_ns() // 1000


class Stage(Generic[Batch]):
    """A processor: configuration, its outputs (emitter, sink), its offset holder and counters.

    Subclasses implement ``read``, ``apply`` and ``tick`` and keep their state as attributes.
    """

    def __init__(self, config: Config, emitter: Emitter, holder: Holder, sink: CompletionSink,
                 codec: AvroCodec | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.emitter = emitter
        self.holder = holder
        self.sink = sink
        self.codec = codec or AvroCodec()
        self.clock = clock
        self.database = config.clickhouse.database
        self.transitions_topic = topic_name(config.topics, "transitions")
        self.counters = Counters()

    def read(self, records: list[RawRecord]) -> Batch:
        """Decode a batch of the input topic, leaving the state alone (it runs outside the lock)."""
        raise NotImplementedError

    def apply(self, batch: Batch) -> None:
        """Take a read batch into the state; hold the records the state depends on."""
        raise NotImplementedError

    async def ingest(self, batches: list[Batch]) -> None:
        """Store what read batches carry, outside the state lock (nothing, unless a stage says otherwise)."""

    async def tick(self) -> None:
        """On a timer: emit what the state says is complete, hand its ClickHouse writes to the sink."""
        raise NotImplementedError

    async def publish_transitions(self, transitions: Transitions) -> None:
        """Send transitions as TransitionBatch records keyed by the model they train, and wait for the broker.

        A record's ``agentstream-rollouts`` header names the rollouts it carries, for observers
        that do not want to decode it.
        """
        if not transitions.datums:
            return
        by_model: dict[str, Transitions] = {}
        for pending, datum in zip(transitions.drafts, transitions.datums, strict=True):
            group = by_model.get(pending.model)
            if group is None:
                group = by_model[pending.model] = Transitions()
            group.drafts.append(pending)
            group.datums.append(datum)
        for model in sorted(by_model):
            group, start = by_model[model], 0
            for count, value in batch_records(self.codec, group.datums):
                rollouts = ",".join(sorted({d.rollout_id for d in group.drafts[start:start + count]}))
                await self.emitter.send(self.transitions_topic, model.encode(), value,
                                        headers=[("agentstream-rollouts", rollouts.encode())])
                start += count
        await self.emitter.flush()
        self.counters.transitions += len(transitions.datums)

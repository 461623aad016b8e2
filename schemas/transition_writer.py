"""Transitions as Avro bytes: deterministic ids, drafts built from a call's encoded token arrays, and their outputs.

A Transition's fields up to its token arrays (ids, names, policy version, step, tokens) are
known when a rollout is assembled; reward, return and advantage come from credit assignment,
for GRPO only once the whole group is in. So a transition is built as a *draft* (the leading
fields' bytes) plus a *tail* (the credit). The token arrays are copied from the span's bytes
as the span reader keeps them (schemas/span_reader.py), never decoded.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from . import binary
from .binary import END, NULL, PRESENT, write_long, write_string
from .catalog import TRANSITION, TRANSITION_BATCH, current_schemas
from .codec import AvroCodec
from .container_file import container_file

_CREDIT = struct.Struct("<ddd")
RECORD_BYTES = 256 * 1024  # a Kafka record of the transitions topic stays well under brokers' 1 MB default limit
TRANSITION_SCHEMA_ID = 1993928380
"""The id of the Transition schema whose field order ``draft`` and ``Draft.complete`` write by hand."""


@functools.cache
def check_layout() -> None:
    """Refuse to write transitions if the bundled Transition schema is not the layout this module writes."""
    binary.check_layout(TRANSITION, TRANSITION_SCHEMA_ID, "agentstream.schemas.transition_writer")


def transition_id(rollout_id: str, attempt_id: str, span_id: str) -> str:
    """Same call, same id: a replay after a crash makes the same transition, which ClickHouse and the trainer dedupe."""
    return hashlib.sha1(f"{rollout_id}/{attempt_id}/{span_id}".encode()).hexdigest()[:32]


def array(count: int, items: bytes | bytearray) -> bytes:
    """An Avro array of ``count`` items already encoded: one block, then the end."""
    return write_long(count) + items + END if count else END


def sample_end(loss_mask: bytes | bytearray, merged_calls: int, split_at_break: bool) -> bytes:
    """The Avro of the fields after the token arrays: ``loss_mask`` (a byte per response token, 1 where the loss
    counts it; empty: every token), ``merged_calls`` and ``split_at_break``."""
    return array(len(loss_mask), loss_mask) + write_long(merged_calls) + bytes((split_at_break,))


ONE_CALL = sample_end(b"", 1, False)
"""loss_mask, merged_calls and split_at_break of a one-call sample: no mask (every token trained), 1 call, no break."""

_REPEATED: dict[str, bytes] = {}  # the Avro of strings every transition of a rollout repeats (rollout, agent, model)
_REPEATED_MAX = 4096


def _repeated_string(value: str) -> bytes:
    """``write_string``, kept for the next call: a rollout's id, its agent and its model come once per transition."""
    written = _REPEATED.get(value)
    if written is None:
        if len(_REPEATED) >= _REPEATED_MAX:
            _REPEATED.clear()
        written = _REPEATED[value] = write_string(value)
    return written


@dataclass(frozen=True)
class Draft:
    """A transition waiting for its credit: the model it trains and the Avro of its fields up to ``split_at_break``."""

    model: str
    rollout_id: str
    head: bytes

    def complete(self, reward: float, return_value: float, advantage: float, group_id: str | None,
                 created_at_us: int) -> bytes:
        """The Transition datum: the draft, then reward, return, advantage, group and creation time."""
        group = PRESENT + write_string(group_id) if group_id else NULL
        return self.head + _CREDIT.pack(reward, return_value, advantage) + group + write_long(created_at_us)


class Call(Protocol):
    """The LLM call a transition is drafted from, as the span reader reads it
    (``agentstream.streams.trajectory.SpanNode``)."""

    @property
    def span_id(self) -> str: ...

    @property
    def policy_version(self) -> int | None: ...

    @property
    def tokens(self) -> bytes: ...


def draft(rollout_id: str, attempt_id: str, agent_name: str, model: str, step_index: int, call: Call) -> Draft:
    """The draft of the transition of ``call``, the ``step_index``-th trainable call of its rollout."""
    return _draft(rollout_id, attempt_id, agent_name, model, step_index, call.span_id, call.policy_version or 0,
                  call.tokens, ONE_CALL)


def merged_draft(rollout_id: str, attempt_id: str, agent_name: str, model: str, step_index: int, first: Call,
                 policy_version: int, sample: bytes) -> Draft:
    """The draft of a trajectory-level sample: ``first`` call's ids and ``sample``, the Avro of its token arrays,
    loss mask, merged_calls and split_at_break (see streams/trajectory_samples.py)."""
    return _draft(rollout_id, attempt_id, agent_name, model, step_index, first.span_id, policy_version, sample, b"")


def _draft(rollout_id: str, attempt_id: str, agent_name: str, model: str, step_index: int, span_id: str,
           policy_version: int, tokens: bytes, end: bytes) -> Draft:
    """The Transition fields in their order, up to ``split_at_break``: ``tokens`` and ``end`` are the rest."""
    head = b"".join((
        write_string(transition_id(rollout_id, attempt_id, span_id)), _repeated_string(rollout_id),
        write_string(span_id), _repeated_string(agent_name), _repeated_string(model),
        write_long(policy_version), write_long(step_index), tokens, end,
    ))
    return Draft(model, rollout_id, head)


def batch_records(codec: AvroCodec, datums: list[bytes]) -> Iterator[tuple[int, bytes]]:
    """TransitionBatch record values of at most about RECORD_BYTES each, with how many transitions each holds."""
    check_layout()
    header = codec.header(TRANSITION_BATCH)
    start, size = 0, 0
    for index, datum in enumerate(datums):
        if size and size + len(datum) > RECORD_BYTES:
            yield index - start, header + write_long(index - start) + b"".join(datums[start:index]) + END
            start, size = index, 0
        size += len(datum)
    if start < len(datums):
        count = len(datums) - start
        yield count, header + write_long(count) + b"".join(datums[start:]) + END


def transitions_container(datums: list[bytes]) -> bytes:
    """An Avro object container file of Transition datums, for ClickHouse's transitions_ingest table."""
    check_layout()
    return container_file(current_schemas()[TRANSITION], datums)

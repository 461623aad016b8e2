"""Transitions as Avro bytes: deterministic ids, drafts built from a call's encoded token arrays, and their outputs.

A Transition's fields up to its token arrays (ids, names, policy version, step, tokens) are
known when a rollout is assembled; reward, return and advantage come from credit assignment,
for GRPO only once the whole group is in. So a transition is built as a *draft* (the leading
fields' bytes) plus a *tail* (the credit). The token arrays are copied from the span's bytes,
never decoded.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from schemas import TRANSITION, TRANSITION_BATCH, AvroCodec, EncodeError, current_schemas, schema_id
from schemas.spanwriter import write_long
from streams.ocf import container_file
from streams.trajectory import SpanNode

_CREDIT = struct.Struct("<ddd")
ONE_CALL = b"\x00\x02\x00"
"""loss_mask, merged_calls and split_at_break of a one-call sample: no mask (every token trained), 1 call, no break."""
RECORD_BYTES = 256 * 1024  # a Kafka record of the transitions topic stays well under brokers' 1 MB default limit
TRANSITION_SCHEMA_ID = 1993928380
"""The id of the Transition schema whose field order ``draft`` and ``Draft.complete`` write by hand."""


@functools.cache
def check_layout() -> None:
    """Refuse to write transitions if the bundled Transition schema is not the layout this module writes."""
    actual = schema_id(current_schemas()[TRANSITION])
    if actual != TRANSITION_SCHEMA_ID:
        raise EncodeError(f"streams.transitions writes the Transition schema with id {TRANSITION_SCHEMA_ID}, but the "
                          f"bundled Transition schema has id {actual}: update draft() and Draft.complete to it")


def transition_id(rollout_id: str, attempt_id: str, span_id: str) -> str:
    """Same call, same id: a replay after a crash makes the same transition, which ClickHouse and the trainer dedupe."""
    return hashlib.sha1(f"{rollout_id}/{attempt_id}/{span_id}".encode()).hexdigest()[:32]


def _string(value: str) -> bytes:
    encoded = value.encode()
    if len(encoded) < 64:  # a one-byte length
        return bytes((len(encoded) << 1,)) + encoded
    return write_long(len(encoded)) + encoded


_REPEATED: dict[str, bytes] = {}  # the Avro of strings every transition of a rollout repeats (rollout, agent, model)
_REPEATED_MAX = 4096


def _repeated_string(value: str) -> bytes:
    """``_string``, kept for the next call: a rollout's id, its agent and its model come once per transition."""
    written = _REPEATED.get(value)
    if written is None:
        if len(_REPEATED) >= _REPEATED_MAX:
            _REPEATED.clear()
        written = _REPEATED[value] = _string(value)
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
        group = b"\x02" + _string(group_id) if group_id else b"\x00"
        return self.head + _CREDIT.pack(reward, return_value, advantage) + group + write_long(created_at_us)


@dataclass(slots=True)
class Transitions:
    """Credited transitions, in step: each one's draft (the model it trains, its rollout) and its Transition datum.

    Two lists rather than an object per transition: thousands are made per second.
    """

    drafts: list[Draft] = field(default_factory=list)
    datums: list[bytes] = field(default_factory=list)


def draft(rollout_id: str, attempt_id: str, agent_name: str, model: str, step_index: int, call: SpanNode) -> Draft:
    """The draft of the transition of ``call``, the ``step_index``-th trainable call of its rollout."""
    head = b"".join((
        _string(transition_id(rollout_id, attempt_id, call.span_id)), _repeated_string(rollout_id),
        _string(call.span_id), _repeated_string(agent_name), _repeated_string(model),
        write_long(call.policy_version or 0), write_long(step_index),
        call.tokens, ONE_CALL,
    ))
    return Draft(model, rollout_id, head)


def merged_draft(rollout_id: str, attempt_id: str, agent_name: str, model: str, step_index: int, first: SpanNode,
                 policy_version: int, sample: bytes) -> Draft:
    """The draft of a trajectory-level sample: ``first`` call's ids and ``sample``, the Avro of its token arrays,
    loss mask, merged_calls and split_at_break (see streams/trajectory_samples.py)."""
    head = b"".join((
        _string(transition_id(rollout_id, attempt_id, first.span_id)), _repeated_string(rollout_id),
        _string(first.span_id), _repeated_string(agent_name), _repeated_string(model),
        write_long(policy_version), write_long(step_index), sample,
    ))
    return Draft(model, rollout_id, head)


def batch_records(codec: AvroCodec, datums: list[bytes]) -> Iterator[tuple[int, bytes]]:
    """TransitionBatch record values of at most about RECORD_BYTES each, with how many transitions each holds."""
    check_layout()
    header = codec.header(TRANSITION_BATCH)
    start, size = 0, 0
    for index, datum in enumerate(datums):
        if size and size + len(datum) > RECORD_BYTES:
            yield index - start, header + write_long(index - start) + b"".join(datums[start:index]) + b"\x00"
            start, size = index, 0
        size += len(datum)
    if start < len(datums):
        count = len(datums) - start
        yield count, header + write_long(count) + b"".join(datums[start:]) + b"\x00"


def transitions_container(datums: list[bytes]) -> bytes:
    """An Avro object container file of Transition datums, for ClickHouse's transitions_ingest table."""
    check_layout()
    return container_file(current_schemas()[TRANSITION], datums)

"""Trajectory-level samples: successive LLM calls of a rollout merged where each extends the last token for token.

A ``[[credit]]`` rule with ``level = "trajectory"`` trains on one sample per run of calls of a
trained model in which every call's prompt token ids start with the previous call's prompt +
response ids. The sample's prompt is its first call's; its response holds each call's response
(loss mask true, the call's logprobs) and, between them, the tokens the model did not generate
(tool results, template glue: mask false, logprob 0.0). Where a call's prompt does not start
that way (retokenization or chat-template drift), the sample ends and a new one starts at that
call with ``split_at_break``. A sample carries the credit, ids and step index of its first call
and the oldest policy version of its calls.

Unlike transition level, which copies a call's token bytes, this decodes them: the comparison
needs the ids.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from infra.config import CreditRule
from schemas.spanwriter import write_long
from streams.credit import Credit
from streams.spanreader import MalformedSpan, compile_reader
from streams.trajectory import SpanNode, Trajectory
from streams.transitions import Draft, merged_draft

log = logging.getLogger("agentstream.streams")

_READ_IDS = compile_reader({"type": "array", "items": "int"})
_READ_FLOATS = compile_reader({"type": "array", "items": "float"})
_END = b"\x00"  # the zero count that ends an Avro array


class UnreadableTokens(MalformedSpan):
    """A call's token bytes that do not read as exactly three arrays: prompt ids, response ids, logprobs."""


@dataclass(frozen=True, slots=True)
class CallTokens:
    """A call's token arrays, decoded."""

    prompt: list[int]
    response: list[int]
    logprobs: list[float]


def decode_tokens(tokens: bytes) -> CallTokens:
    """Read ``SpanNode.tokens`` (the Avro arrays as the span reader keeps them, any block form) into lists."""
    try:
        prompt, position = _READ_IDS(tokens, 0)
        response, position = _READ_IDS(tokens, position)
        logprobs, position = _READ_FLOATS(tokens, position)
    except (IndexError, struct.error) as error:
        raise UnreadableTokens(f"token arrays cut short: {error}") from None
    if position != len(tokens):
        raise UnreadableTokens(f"token arrays take {position} of {len(tokens)} bytes")
    return CallTokens(prompt, response, logprobs)


def encode_ids(ids: Sequence[int]) -> bytes:
    """An Avro array of int: one block, then the end."""
    if not ids:
        return _END
    return write_long(len(ids)) + b"".join(map(write_long, ids)) + _END


def encode_floats(values: Sequence[float]) -> bytes:
    """An Avro array of float (little-endian binary32): one block, then the end."""
    if not values:
        return _END
    return write_long(len(values)) + struct.pack(f"<{len(values)}f", *values) + _END


def encode_mask(mask: Sequence[bool]) -> bytes:
    """An Avro array of boolean (a byte 0 or 1 each): one block, then the end."""
    if not mask:
        return _END
    return write_long(len(mask)) + bytes(mask) + _END


@dataclass(slots=True)
class _Sample:
    """A sample being built: its first call and the arrays it holds so far (empty for a call that stands alone)."""

    first: SpanNode
    step_index: int
    model: str
    split: bool
    policy_version: int
    prompt: list[int] = field(default_factory=list)
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)  # empty while the sample holds one call
    calls: int = 1

    def extends(self, call: CallTokens) -> bool:
        """Whether ``call``'s prompt starts with this sample's prompt + response (the previous call's sequence)."""
        cut = len(self.prompt)
        end = cut + len(self.response)
        return len(call.prompt) >= end and call.prompt[:cut] == self.prompt and call.prompt[cut:end] == self.response

    def merge(self, call: CallTokens, version: int) -> None:
        """Append ``call``: the tokens between (mask false, logprob 0.0), then its response."""
        if self.calls == 1:
            self.mask = [True] * len(self.response)
        glue = call.prompt[len(self.prompt) + len(self.response):]
        self.response += glue
        self.response += call.response
        self.logprobs += [0.0] * len(glue)
        self.logprobs += call.logprobs
        self.mask += [False] * len(glue)
        self.mask += [True] * len(call.response)
        self.calls += 1
        self.policy_version = min(self.policy_version, version)

    def body(self) -> bytes:
        """The Avro of the token arrays, loss mask, merged_calls and split_at_break (a one-call sample copies its
        call's token bytes as they are)."""
        if self.calls == 1:
            return self.first.tokens + encode_mask(()) + write_long(1) + bytes((self.split,))
        return b"".join((encode_ids(self.prompt), encode_ids(self.response), encode_floats(self.logprobs),
                         encode_mask(self.mask), write_long(self.calls), bytes((self.split,))))


@dataclass(frozen=True, slots=True)
class TrajectorySamples:
    """A rollout's trajectory-level drafts in the order of their first calls, each one's credit, and the counts.

    ``credits`` is empty on the GRPO path, where the group credits the drafts later.
    ``merges``: calls merged into a sample before them; ``breaks``: samples split where the prefix broke.
    """

    drafts: list[Draft]
    credits: list[Credit]
    merges: int
    breaks: int


def trajectory_samples(trajectory: Trajectory, rule: CreditRule,
                       credits: Sequence[Credit] | None = None) -> TrajectorySamples:
    """Merge the trainable calls of ``trajectory`` into trajectory-level samples, per trained model.

    ``credits`` are the rollout's credits (one per trainable call, in order); None on the GRPO
    path, where the trainable calls are taken in order. Calls of one trained model (``train_as``
    or the call's model) merge; a call of another model neither merges nor breaks them. A call
    whose token bytes do not decode, or whose logprobs do not match its response, stands alone
    as transition level would make it, and the next call of its model starts a new sample.
    """
    steps: Iterable[tuple[SpanNode, int, Credit | None]] = (
        ((call, index, None) for index, call in enumerate(trajectory.trainable_calls)) if credits is None
        else ((credit.call, credit.step_index, credit) for credit in credits))
    samples: list[_Sample] = []
    kept: list[Credit] = []
    current: dict[str, _Sample] = {}  # each trained model's open sample
    merges = breaks = 0
    for call, step_index, credit in steps:
        model = rule.train_as or call.model
        version = call.policy_version or 0
        tokens = _readable(trajectory, call)
        sample = current.pop(model, None)
        if tokens is not None and sample is not None and sample.extends(tokens):
            sample.merge(tokens, version)
            current[model] = sample
            merges += 1
            continue
        split = tokens is not None and sample is not None
        breaks += split
        sample = _Sample(call, step_index, model, split, version)
        if tokens is not None:
            sample.prompt, sample.response, sample.logprobs = tokens.prompt, tokens.response, tokens.logprobs
            current[model] = sample
        samples.append(sample)
        if credit is not None:
            kept.append(credit)
    drafts = [merged_draft(trajectory.rollout_id, trajectory.attempt_id, trajectory.agent_name, sample.model,
                           sample.step_index, sample.first, sample.policy_version, sample.body())
              for sample in samples]
    return TrajectorySamples(drafts, kept, merges, breaks)


def _readable(trajectory: Trajectory, call: SpanNode) -> CallTokens | None:
    """``call``'s decoded token arrays, or None where it cannot merge: unreadable, or logprobs not one per token."""
    try:
        tokens = decode_tokens(call.tokens)
    except UnreadableTokens as error:
        log.warning("call %s of rollout %s stands alone: %s", call.span_id, trajectory.rollout_id, error)
        return None
    return tokens if len(tokens.logprobs) == len(tokens.response) else None

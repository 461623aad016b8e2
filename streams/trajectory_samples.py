"""Trajectory-level samples: successive LLM calls of a rollout merged where each extends the last token for token.

A ``[[credit]]`` rule with ``level = "trajectory"`` trains on one sample per run of calls of a
trained model in which every call's prompt token ids start with the previous call's prompt +
response ids. The sample's prompt is its first call's; its response holds each call's response
(loss mask true, the call's logprobs) and, between them, the tokens the model did not generate
(tool results, template glue: mask false, logprob 0.0). Where a call's prompt does not start
that way (retokenization or chat-template drift), the sample ends and a new one starts at that
call with ``split_at_break``. A sample carries the credit, ids and step index of its first call
and the oldest policy version of its calls. Demonstrations (calls without logprobs) merge the same
way into samples without logprobs; a demonstration and a sampled call never share a sample.

The ids are compared as their Avro bytes, not decoded: a zigzag varint is a prefix-free code, so
one run of varints starts with another exactly when its first ids are the other's ids. (A writer
that pads a varint with needless bytes would make a break, never a wrong merge; Avro writers do
not.) A one-call sample copies its call's token bytes, as transition level does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from agentstream.infra.config import CreditRule
from agentstream.schemas.binary import END
from agentstream.schemas.span_reader import MalformedSpan, array_items
from agentstream.schemas.transition_writer import Draft, array, merged_draft, sample_end
from agentstream.streams.credit import Credit
from agentstream.streams.trajectory import SpanNode, Trajectory

log = logging.getLogger("agentstream.streams")

_CONTINUATION = bytes(range(0x80, 0x100))  # the bytes of a varint before its last
_FLOAT_ZERO = b"\x00" * 4  # 0.0 as an Avro float


class UnreadableTokens(MalformedSpan):
    """A call's token bytes that do not read as exactly three arrays: prompt ids, response ids, logprobs."""


@dataclass(frozen=True, slots=True)
class CallArrays:
    """A call's token arrays as their items' bytes: ids as zigzag varints back to back, logprobs as float32s."""

    prompt: bytes
    prompt_count: int
    response: bytes
    response_count: int
    logprobs: bytes


def varint_count(items: bytes) -> int:
    """How many varints ``items`` holds (each ends with a byte below 0x80)."""
    return len(items.translate(None, _CONTINUATION))


def call_arrays(tokens: bytes) -> CallArrays:
    """Split ``SpanNode.tokens`` (the arrays as the span reader keeps them, in any blocks) into their items' bytes.

    Raises :class:`UnreadableTokens` where they are not exactly three arrays, or a block's count
    does not match its items (a varint cut off, or a size that holds more or fewer items).
    """
    try:
        prompt, prompt_count, position = array_items(tokens, 0, None)
        response, response_count, position = array_items(tokens, position, None)
        logprobs, logprob_count, position = array_items(tokens, position, 4)
    except (MalformedSpan, IndexError) as error:
        raise UnreadableTokens(f"token arrays cut short: {error}") from None
    if position != len(tokens):
        raise UnreadableTokens(f"token arrays take {position} of {len(tokens)} bytes")
    for name, items, count in (("prompt", prompt, prompt_count), ("response", response, response_count)):
        if varint_count(items) != count or (items and items[-1] & 0x80):
            raise UnreadableTokens(f"{name} ids: {len(items)} bytes do not hold the {count} ids their blocks count")
    if len(logprobs) != 4 * logprob_count:
        raise UnreadableTokens(f"logprobs: {len(logprobs)} bytes do not hold the {logprob_count} floats counted")
    return CallArrays(prompt, prompt_count, response, response_count, logprobs)


@dataclass(slots=True)
class _Sample:
    """A sample being built: its first call and the ids (as varints), logprobs and mask it holds so far."""

    first: SpanNode
    step_index: int
    model: str
    split: bool
    policy_version: int
    prompt: bytes = b""
    prompt_count: int = 0
    response: bytearray = field(default_factory=bytearray)
    response_count: int = 0
    logprobs: bytearray = field(default_factory=bytearray)
    mask: bytearray = field(default_factory=bytearray)  # empty while the sample holds one call
    calls: int = 1

    @property
    def demonstration(self) -> bool:
        """A sample of calls without logprobs (scripted answers): it stays without logprobs."""
        return not self.logprobs and self.response_count > 0

    @classmethod
    def start(cls, call: SpanNode, step_index: int, model: str, split: bool, arrays: CallArrays) -> _Sample:
        return cls(call, step_index, model, split, call.policy_version or 0, arrays.prompt, arrays.prompt_count,
                   bytearray(arrays.response), arrays.response_count, bytearray(arrays.logprobs))

    def extends(self, call: CallArrays) -> bool:
        """Whether ``call``'s prompt starts with this sample's prompt + response (the previous call's sequence)."""
        return call.prompt.startswith(self.prompt) and call.prompt.startswith(self.response, len(self.prompt))

    def merge(self, call: CallArrays, version: int) -> None:
        """Append ``call``: the tokens between (mask false, logprob 0.0), then its response."""
        if self.calls == 1:
            self.mask += b"\x01" * self.response_count
        glue = call.prompt[len(self.prompt) + len(self.response):]
        between = varint_count(glue)
        self.response += glue
        self.response += call.response
        self.response_count += between + call.response_count
        if not self.demonstration:
            self.logprobs += _FLOAT_ZERO * between
            self.logprobs += call.logprobs
        self.mask += b"\x00" * between
        self.mask += b"\x01" * call.response_count
        self.calls += 1
        self.policy_version = min(self.policy_version, version)

    def body(self) -> bytes:
        """The Avro of the token arrays, loss mask, merged_calls and split_at_break (a one-call sample copies its
        call's token bytes as they are)."""
        if self.calls == 1:
            return self.first.tokens + sample_end(b"", 1, self.split)
        logprobs = array(self.response_count, self.logprobs) if self.logprobs else END
        return b"".join((array(self.prompt_count, self.prompt), array(self.response_count, self.response),
                         logprobs, sample_end(self.mask, self.calls, self.split)))


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
    whose logprobs do not match its response stands alone, as transition level would make it; one
    whose token bytes do not read as three arrays makes no sample (logged). After either, the next
    call of its model starts a new sample.
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
        sample = current.pop(model, None)
        try:
            arrays = call_arrays(call.tokens)
        except UnreadableTokens as error:  # copied, they would make a datum no reader can read
            log.warning("no sample from call %s of rollout %s: %s", call.span_id, trajectory.rollout_id, error)
            continue
        demonstration = not arrays.logprobs
        if not demonstration and len(arrays.logprobs) != 4 * arrays.response_count:  # not one logprob per token:
            sample = _Sample(call, step_index, model, False, version)  # it stands alone (the trainer refuses it)
        elif sample is not None and sample.demonstration != demonstration:  # never one sample: not a break either
            sample = current[model] = _Sample.start(call, step_index, model, False, arrays)
        elif sample is not None and sample.extends(arrays):
            sample.merge(arrays, version)
            current[model] = sample
            merges += 1
            continue
        else:
            breaks += sample is not None
            sample = current[model] = _Sample.start(call, step_index, model, sample is not None, arrays)
        samples.append(sample)
        if credit is not None:
            kept.append(credit)
    drafts = [merged_draft(trajectory.rollout_id, trajectory.attempt_id, trajectory.agent_name, sample.model,
                           sample.step_index, sample.first, sample.policy_version, sample.body())
              for sample in samples]
    return TrajectorySamples(drafts, kept, merges, breaks)


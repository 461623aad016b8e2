"""From transitions to training batches: dedupe by transition id, drop stale ones, close batches, pad into tensors.

A batch closes when its padded size (transitions × longest sequence) would pass the token
budget, when it holds ``batch_transitions`` transitions, or when its oldest transition has
waited ``batch_wait_s``. With ``count_skipped``, the transitions skipped for carrying no signal
count toward ``batch_transitions`` too, where they arrived: a step then follows a fixed amount
of generated experience, however many of its groups were flat, as a plain generate-then-train
loop steps once per round of generation, and a backlog of several rounds is cut where each round
ends (not wherever ``batch_transitions`` informative transitions have gathered, which split
groups across steps). Staleness is judged when a transition arrives and again when its batch is
taken: ``current_version − policy_version > max_policy_lag`` drops it (and counts it).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

PACKED_ROW_TOKENS = 512  # a longer row holds the prompt again: attention is quadratic in a row's length


class TransitionError(ValueError):
    """A transition that cannot be trained on: no prompt or response, or logprobs that do not match the tokens."""


class NonFiniteTransition(TransitionError):
    """A transition whose reward, advantage or a behaviour logprob is NaN or infinite: one would make the loss NaN."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One transition as the trainer needs it, with the Kafka position it was read from (None from memory)."""

    transition_id: str
    rollout_id: str
    policy_version: int
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    advantage: float
    position: tuple[str, int, int] | None = None  # topic, partition, offset

    @classmethod
    def from_record(cls, record: Mapping[str, Any], position: tuple[str, int, int] | None = None) -> Sample:
        """A Sample from a decoded Transition record (schemas/avro/transition.avsc)."""
        prompt, response = record["prompt_token_ids"], record["response_token_ids"]
        logprobs = record["behaviour_logprobs"]
        if not prompt or not response:
            raise TransitionError(f"transition {record['transition_id']} has no prompt or no response tokens")
        if len(logprobs) != len(response):
            raise TransitionError(f"transition {record['transition_id']} has {len(logprobs)} logprobs for "
                                  f"{len(response)} response tokens")
        reward, advantage = float(record["reward"]), float(record["advantage"])
        if not (math.isfinite(reward) and math.isfinite(advantage)):
            raise NonFiniteTransition(f"transition {record['transition_id']} has reward {reward!r} and advantage "
                                      f"{advantage!r}: both must be finite")
        if not all(map(math.isfinite, logprobs)):
            raise NonFiniteTransition(f"transition {record['transition_id']} has a behaviour logprob that is not "
                                      f"finite ({next(v for v in logprobs if not math.isfinite(v))!r})")
        return cls(record["transition_id"], record["rollout_id"], int(record["policy_version"]), list(prompt),
                   list(response), list(logprobs), reward, advantage, position)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


class SeenIds:
    """The ids of the newest ``capacity`` transitions taken for training, oldest forgotten first."""

    def __init__(self, capacity: int, initial: Iterable[str] = ()) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()
        for transition_id in initial:
            self.add(transition_id)

    def __contains__(self, transition_id: str) -> bool:
        return transition_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, transition_id: str) -> None:
        self._ids[transition_id] = None
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


@dataclass
class Counts:
    """What happened to the transitions offered since the counts were last taken."""

    duplicate: int = 0
    stale: int = 0
    uninformative: int = 0
    invalid: int = 0
    uninformative_rewards: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Batch:
    """The transitions of one optimizer step, with the version they were judged against and what was dropped."""

    samples: list[Sample]
    current_version: int
    counts: Counts

    @property
    def response_tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.samples)

    def lags(self) -> list[int]:
        return [self.current_version - s.policy_version for s in self.samples]

    def rewards(self) -> list[float]:
        """Rewards of every fresh transition behind this step, the uninformative ones skipped for training included."""
        return [s.reward for s in self.samples] + self.counts.uninformative_rewards

    def advantage_stats(self) -> tuple[float, float]:
        values = [s.advantage for s in self.samples]
        return statistics.fmean(values), statistics.pstdev(values)


class Batcher:
    """Accepts transitions one by one and hands out batches; remembers which ids it has already handed out."""

    def __init__(self, *, batch_tokens: int, batch_transitions: int, batch_wait_s: float, max_policy_lag: int,
                 skip_zero_advantage: bool, seen: SeenIds, count_skipped: bool = False) -> None:
        self.batch_tokens = batch_tokens
        self.batch_transitions = batch_transitions
        self.batch_wait_s = batch_wait_s
        self.max_policy_lag = max_policy_lag
        self.skip_zero_advantage = skip_zero_advantage
        self.count_skipped = count_skipped
        self.seen = seen
        self._skipped = 0  # flat transitions offered since the last queued one
        self.counts = Counts()
        self._queue: deque[tuple[float, Sample, int]] = deque()  # (arrived, sample, flat ones offered just before it)
        self._queued: set[str] = set()

    def __len__(self) -> int:
        return len(self._queue)

    def offer(self, sample: Sample, current_version: int, now: float) -> bool:
        """Queue a sample for training; False (and counted) when it is a duplicate, stale or carries no signal."""
        if sample.transition_id in self.seen or sample.transition_id in self._queued:
            self.counts.duplicate += 1
            return False
        if current_version - sample.policy_version > self.max_policy_lag:
            self.counts.stale += 1
            return False
        if self.skip_zero_advantage and sample.advantage == 0.0:
            self.seen.add(sample.transition_id)
            self.counts.uninformative += 1
            self.counts.uninformative_rewards.append(sample.reward)
            self._skipped += 1
            if not self._queue and self._skipped >= self.batch_transitions:
                self._skipped = 0  # a batch's worth with no signal at all: nothing to step on, start the next one
            return False
        self._queue.append((now, sample, self._skipped))
        self._skipped = 0
        self._queued.add(sample.transition_id)
        return True

    def pending_positions(self) -> Iterable[tuple[str, int, int]]:
        """Kafka positions of the queued samples (not yet trained, so not yet committable)."""
        return (sample.position for _, sample, _ in self._queue if sample.position is not None)

    def ready(self, now: float) -> bool:
        """Whether a batch should be taken now: the budget or the count is reached, or the oldest waited long enough."""
        if not self._queue:
            return False
        if self.batch_wait_s and now - self._queue[0][0] >= self.batch_wait_s:
            return True
        offered = len(self._queue)
        if self.count_skipped:
            offered += sum(skipped for _, _, skipped in self._queue) + self._skipped
        full = bool(self.batch_transitions) and offered >= self.batch_transitions
        return full or self._fits() < len(self._queue)

    def take(self, current_version: int) -> Batch | None:
        """The next batch (queue order), stale samples dropped; None when nothing fresh is queued."""
        samples: list[Sample] = []
        room = self.batch_transitions
        for _ in range(self._fits()):
            _, sample, skipped = self._queue.popleft()
            room -= 1 + (skipped if self.count_skipped else 0)
            self._queued.discard(sample.transition_id)
            if current_version - sample.policy_version > self.max_policy_lag:
                self.counts.stale += 1
                continue
            self.seen.add(sample.transition_id)
            samples.append(sample)
        if self.count_skipped and self.batch_transitions and room > 0:  # flat ones next in line fill the room left
            if self._queue:
                arrived, head, skipped = self._queue[0]
                self._queue[0] = (arrived, head, max(0, skipped - room))
            else:
                self._skipped = max(0, self._skipped - room)
        if not samples:  # everything was stale: the counts go with the next batch
            return None
        counts, self.counts = self.counts, Counts()
        return Batch(samples, current_version, counts)

    def _fits(self) -> int:
        """How many queued samples, from the front, fit one batch (at least one, however long it is)."""
        longest = counted = 0
        for count, (_, sample, skipped) in enumerate(self._queue, start=1):
            longest = max(longest, sample.length)
            counted += 1 + (skipped if self.count_skipped else 0)
            if count > 1 and self.batch_transitions and counted > self.batch_transitions:
                return count - 1
            if self.batch_tokens and count * longest > self.batch_tokens and count > 1:
                return count - 1
        return len(self._queue)


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors of some samples: inputs, and per predicted position the target, masks and behaviour logprobs.

    Sequences are right-padded. Column c of ``targets``/``response_mask``/``behaviour_logprobs``
    is the token at position ``first + c + 1``, predicted by the logits at ``first + c``; ``first``
    is the last position of the shortest prompt, so no column lies wholly inside the prompts and
    the model only has to compute logits (the costly vocabulary projection) for the last
    ``L - first`` positions.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L - 1 - first]
    response_mask: torch.Tensor  # [B, L - 1 - first]
    behaviour_logprobs: torch.Tensor  # [B, L - 1 - first]
    advantages: torch.Tensor  # [B]
    first: int = 0

    @property
    def logits_to_keep(self) -> int:
        """How many final positions' logits cover every column (one more than needed; the last is dropped)."""
        return self.input_ids.shape[1] - self.first


@dataclass(frozen=True)
class PackedMicroBatch:
    """Samples that share prompts, as a GRPO group does, packed: a row holds a prompt once, then responses to it.

    Each response attends to its prompt and to itself only (``attends``, a block-causal mask), with
    positions that continue its prompt's (``position_ids``), so it sees exactly what it saw alone,
    while the prompt runs once per row and every weight is used by one matmul (on a CPU that made
    a SmolLM2 step a fifth to two fifths shorter than reusing the prompt's KV cache, which used each
    weight twice: ``bench.step``). Response ``r`` lies in row ``row_of[r]``; its column c is
    predicted by the hidden state at ``predictors[r, c]`` of that row. Rows are right-padded.
    """

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    attends: torch.Tensor  # [R, L, L] bool: query position attends to key position
    row_of: torch.Tensor  # [B]
    predictors: torch.Tensor  # [B, Lr]
    response_ids: torch.Tensor  # [B, Lr]
    response_mask: torch.Tensor  # [B, Lr]
    behaviour_logprobs: torch.Tensor  # [B, Lr]
    advantages: torch.Tensor  # [B]

    @property
    def targets(self) -> torch.Tensor:
        return self.response_ids


def collate(samples: list[Sample], pad_id: int, device: torch.device | str, micro_batches: int = 1,
            row_tokens: int = PACKED_ROW_TOKENS) -> list[MicroBatch | PackedMicroBatch]:
    """Split samples into padded micro-batches; a micro-batch whose samples repeat a prompt is packed (see above).

    Samples are sorted by length (to waste little padding), or, when prompts repeat, by prompt so
    that a group's samples land in the same micro-batch. A packed row takes responses to its prompt
    while it stays within ``row_tokens``; the next starts a new row with the prompt again.
    """
    shared = len({tuple(s.prompt_ids) for s in samples}) < len(samples)
    ordered = sorted(samples, key=(lambda s: (len(s.prompt_ids), s.prompt_ids, len(s.response_ids))) if shared
                     else (lambda s: s.length))
    size = -(-len(ordered) // micro_batches)
    chunks = [ordered[i:i + size] for i in range(0, len(ordered), size)]
    return [_pack(chunk, pad_id, device, row_tokens) if len({tuple(s.prompt_ids) for s in chunk}) < len(chunk)
            else _pad(chunk, pad_id, device) for chunk in chunks]


def _pad(samples: list[Sample], pad_id: int, device: torch.device | str) -> MicroBatch:
    length = max(s.length for s in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), length), dtype=torch.long)
    response_mask = torch.zeros((len(samples), length - 1), dtype=torch.bool)
    behaviour = torch.zeros((len(samples), length - 1), dtype=torch.float32)
    for row, sample in enumerate(samples):
        prompt, response = len(sample.prompt_ids), len(sample.response_ids)
        input_ids[row, :sample.length] = torch.tensor(sample.prompt_ids + sample.response_ids)
        attention[row, :sample.length] = 1
        response_mask[row, prompt - 1:prompt - 1 + response] = True
        behaviour[row, prompt - 1:prompt - 1 + response] = torch.tensor(sample.behaviour_logprobs)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    first = min(len(s.prompt_ids) for s in samples) - 1
    return MicroBatch(input_ids.to(device), attention.to(device), input_ids[:, first + 1:].to(device),
                      response_mask[:, first:].to(device), behaviour[:, first:].to(device), advantages.to(device),
                      first)


def _pack(samples: list[Sample], pad_id: int, device: torch.device | str, row_tokens: int) -> PackedMicroBatch:
    rows: list[tuple[list[int], list[Sample]]] = []  # a prompt and the responses after it in one row
    open_rows: dict[tuple[int, ...], int] = {}
    for sample in samples:
        prompt_key = tuple(sample.prompt_ids)
        number = open_rows.get(prompt_key)
        if number is None or len(rows[number][0]) + len(sample.response_ids) > row_tokens:
            open_rows[prompt_key], number = len(rows), len(rows)
            rows.append((list(sample.prompt_ids), []))
        rows[number][0].extend(sample.response_ids)
        rows[number][1].append(sample)
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)  # 0: the prompt, k: the k-th response, -1: pad
    ordered: list[Sample] = []
    row_of: list[int] = []
    starts: list[int] = []
    for number, (ids, members) in enumerate(rows):
        prompt = len(members[0].prompt_ids)
        input_ids[number, :len(ids)] = torch.tensor(ids)
        positions[number, :prompt] = torch.arange(prompt)
        segments[number, :prompt] = 0
        start = prompt
        for k, sample in enumerate(members, start=1):
            end = start + len(sample.response_ids)
            positions[number, start:end] = torch.arange(prompt, prompt + len(sample.response_ids))
            segments[number, start:end] = k
            ordered.append(sample)
            row_of.append(number)
            starts.append(start)
            start = end
    index = torch.arange(width)
    query, key = segments[:, :, None], segments[:, None, :]  # each position's segment, as query and as key
    attends = (index[:, None] >= index[None, :]) & (query >= 0) & (key >= 0) & ((key == 0) | (key == query))
    attends |= torch.eye(width, dtype=torch.bool)  # a pad attends to itself: no row of the softmax is empty
    length = max(len(s.response_ids) for s in ordered)
    predictors = torch.zeros((len(ordered), length), dtype=torch.long)
    response_ids = torch.full((len(ordered), length), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(ordered), length), dtype=torch.bool)
    behaviour = torch.zeros((len(ordered), length), dtype=torch.float32)
    for row, (sample, start) in enumerate(zip(ordered, starts, strict=True)):
        count = len(sample.response_ids)
        predictors[row, 0] = len(sample.prompt_ids) - 1  # the prompt's last position predicts the first token
        predictors[row, 1:count] = torch.arange(start, start + count - 1)
        response_ids[row, :count] = torch.tensor(sample.response_ids)
        response_mask[row, :count] = True
        behaviour[row, :count] = torch.tensor(sample.behaviour_logprobs)
    advantages = torch.tensor([s.advantage for s in ordered], dtype=torch.float32)
    return PackedMicroBatch(input_ids.to(device), positions.to(device), attends.to(device),
                            torch.tensor(row_of, dtype=torch.long, device=device), predictors.to(device),
                            response_ids.to(device), response_mask.to(device), behaviour.to(device),
                            advantages.to(device))

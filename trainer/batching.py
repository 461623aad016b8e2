"""From transitions to training batches: dedupe by transition id, drop stale ones, close batches, pad into tensors.

A batch closes when its padded size (transitions × longest sequence) would pass the token
budget, when it holds ``batch_transitions`` transitions, or when its oldest transition has
waited ``batch_wait_s`` (a batch of demonstrations, sent in bulk and never stale, once they have
stopped coming for that long: a warm start steps on full batches however slowly the machine
delivers them). With ``count_skipped``, the transitions skipped for carrying no signal count toward
``batch_transitions`` too, where they arrived: a step then follows a fixed amount
of generated experience, however many of its groups were flat, as a plain generate-then-train
loop steps once per round of generation, and a backlog of several rounds is cut where each round
ends (not wherever ``batch_transitions`` informative transitions have gathered, which split
groups across steps); the count never splits a group either (``group_id``), the token budget may.
Staleness is judged when a transition arrives and again when its batch is taken:
``current_version − policy_version > max_policy_lag`` drops it (and counts it), and the rest of its
group with it: a rollout's calls can span a hot swap, so one group holds samples of two versions, and
the fresh half alone would train without the mean its advantages were centred on. A demonstration
never goes stale: the bound keeps importance ratios against old behaviour policies in check, and a
demonstration has none (a warm start's scripted trajectories train at any version).
A batch is then cut into micro-batches (``collate``), at most ``micro_batch_tokens`` padded tokens
each where that is set, and its samples' loss masks and token weights go into the tensors.

It is one module of about 500 lines on purpose: dedupe, staleness, closing and collation decide together which
transitions a step sees, and each rule refers to the others.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from agentstream.infra.config import TrainerConfig
from agentstream.schemas.errors import AgentstreamError
from agentstream.trainer.errors import TrainerConfigError

PACKED_ROW_TOKENS = 512  # a longer row holds the prompt again: attention is quadratic in a row's length


class TransitionError(AgentstreamError, ValueError):
    """A transition that cannot be trained on: no prompt or response, or logprobs that do not match the tokens."""


class NonFiniteTransition(TransitionError):
    """A transition whose reward, advantage or a behaviour logprob is NaN or infinite: one would make the loss NaN."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One transition as the trainer needs it, with the Kafka position it was read from (None from memory).

    ``loss_mask`` marks the response tokens the loss counts (empty: every one); a trajectory-level
    sample's response also holds the tokens between its calls (tool results, template glue), which
    are inputs only. Empty ``behaviour_logprobs`` make a demonstration: its tokens train by
    likelihood (``trainer/loss.py``).
    """

    transition_id: str
    rollout_id: str
    policy_version: int
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    advantage: float
    position: tuple[str, int, int] | None = None  # topic, partition, offset
    loss_mask: tuple[bool, ...] = ()
    merged_calls: int = 1
    split_at_break: bool = False
    return_value: float | None = None  # None: the reward (a sample made in memory)
    group_id: str | None = None  # the GRPO group its advantage was computed in; None: none

    @classmethod
    def from_record(cls, record: Mapping[str, Any], position: tuple[str, int, int] | None = None) -> Sample:
        """A Sample from a decoded Transition record (schemas/avro/transition.avsc).

        A record written before the loss mask reads as one call with every response token trained.
        """
        tid = record["transition_id"]
        prompt, response = record["prompt_token_ids"], record["response_token_ids"]
        logprobs, mask = record["behaviour_logprobs"], tuple(record.get("loss_mask") or ())
        if not prompt or not response:
            raise TransitionError(f"transition {tid} has no prompt or no response tokens")
        if mask and len(mask) != len(response):
            raise TransitionError(f"transition {tid} has a loss mask of {len(mask)} for {len(response)} response "
                                  f"tokens")
        if mask and not any(mask):
            raise TransitionError(f"transition {tid} has a loss mask that trains no token")
        if logprobs and len(logprobs) != len(response):
            raise TransitionError(f"transition {tid} has {len(logprobs)} logprobs for {len(response)} response "
                                  f"tokens")
        reward, advantage = float(record["reward"]), float(record["advantage"])
        returned = float(record.get("return_value", reward))
        if not (math.isfinite(reward) and math.isfinite(advantage) and math.isfinite(returned)):
            raise NonFiniteTransition(f"transition {tid} has reward {reward!r}, return {returned!r} and advantage "
                                      f"{advantage!r}: all must be finite")
        if not logprobs and advantage <= 0:
            raise TransitionError(f"transition {tid} is a demonstration (no behaviour logprobs) with advantage "
                                  f"{advantage!r}: only a positive one can train by likelihood")
        trained = [value for value, kept in zip(logprobs, mask, strict=True) if kept] if mask and logprobs else logprobs
        if not all(map(math.isfinite, trained)):
            raise NonFiniteTransition(f"transition {tid} has a behaviour logprob that is not finite "
                                      f"({next(v for v in trained if not math.isfinite(v))!r})")
        return cls(tid, record["rollout_id"], int(record["policy_version"]), list(prompt), list(response),
                   list(logprobs), reward, advantage, position, mask, int(record.get("merged_calls", 1)),
                   bool(record.get("split_at_break", False)), returned, record.get("group_id"))

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def demonstration(self) -> bool:
        """No behaviour policy: a span written with token ids but no logprobs (a scripted trajectory, say)."""
        return not self.behaviour_logprobs

    @property
    def rollout_reward(self) -> float:
        """What the rollout earned from this sample's call on: its return, the reward where none was recorded.

        The return, not the reward: with ``final``, ``running_baseline`` and ``group`` credit
        (``streams/credit.py``) both are the rollout's final reward on every call, but with
        ``discounted`` credit the reward is only what arrived right after the call (0 for the
        early calls of a tool loop that succeeded) and the return is everything earned from that
        call on, the outcome the call led to.
        """
        return self.reward if self.return_value is None else self.return_value

    @property
    def trained(self) -> list[bool]:
        """Per response token, whether the loss counts it."""
        return list(self.loss_mask) if self.loss_mask else [True] * len(self.response_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(self.trained)


class SeenIds:
    """The newest ``capacity`` ids, oldest forgotten first: of transitions taken for training, of stale groups."""

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
    below_threshold: int = 0  # supervised: the rollout's reward was below ``supervised_min_reward``
    skipped_rewards: list[float] = field(default_factory=list)  # of the uninformative and below-threshold ones


@dataclass(frozen=True)
class Batch:
    """The transitions of one optimizer step, with the version they were judged against and what was dropped."""

    samples: list[Sample]
    current_version: int
    counts: Counts

    @property
    def calls_per_sample(self) -> float:
        """The mean number of LLM calls merged into each sample (1 at transition level)."""
        return statistics.fmean(s.merged_calls for s in self.samples)

    @property
    def prefix_breaks(self) -> int:
        """Samples that start where a rollout's token prefix broke (trajectory level)."""
        return sum(s.split_at_break for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.samples)

    def lags(self) -> list[int]:
        """Policy lag of each sampled transition (a demonstration has no behaviour policy to lag behind)."""
        return [self.current_version - s.policy_version for s in self.samples if not s.demonstration]

    def rewards(self) -> list[float]:
        """Rewards of every fresh transition behind this step, those skipped for training (no signal, below the
        supervised threshold) included."""
        return [s.reward for s in self.samples] + self.counts.skipped_rewards

    def advantage_stats(self) -> tuple[float, float]:
        values = [s.advantage for s in self.samples]
        return statistics.fmean(values), statistics.pstdev(values)


def supervised(sample: Sample) -> Sample:
    """The sample to train by likelihood alone: a demonstration (no behaviour logprobs) with advantage 1.

    The loss's likelihood term −A·logp_t is then the negative log-likelihood of its trained
    tokens, under the same loss mask and token weights as a policy-gradient sample, whatever
    advantage credit gave it (a group where every rollout succeeded has advantage 0, and is
    exactly what supervised training wants); as a demonstration it never goes stale either.
    """
    return replace(sample, behaviour_logprobs=[], advantage=1.0)


class Batcher:
    """Accepts transitions one by one and hands out batches; remembers which ids it has already handed out.

    With ``min_reward`` (``trainer.objective = "supervised"``) it takes only samples whose rollout
    reward (``Sample.rollout_reward``) is at least that, as ``supervised`` samples, and counts the
    others (``Counts.below_threshold``); otherwise samples keep their advantages (policy gradient).
    """

    def __init__(self, *, batch_tokens: int, batch_transitions: int, batch_wait_s: float, max_policy_lag: int,
                 skip_zero_advantage: bool, seen: SeenIds, count_skipped: bool = False,
                 min_reward: float | None = None) -> None:
        self.min_reward = min_reward
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
        self._stale_groups = SeenIds(seen.capacity)  # groups with a stale sample: the rest of each goes too

    @classmethod
    def for_trainer(cls, settings: TrainerConfig, seen: SeenIds) -> Batcher:
        """The batcher a trainer with ``settings`` steps on (its supervised threshold only for that objective)."""
        return cls(batch_tokens=settings.batch_tokens, batch_transitions=settings.batch_transitions,
                   batch_wait_s=settings.batch_wait_s, max_policy_lag=settings.max_policy_lag,
                   skip_zero_advantage=settings.skip_zero_advantage, count_skipped=settings.batch_counts_skipped,
                   seen=seen,
                   min_reward=settings.supervised_min_reward if settings.objective == "supervised" else None)

    def __len__(self) -> int:
        return len(self._queue)

    def offer(self, sample: Sample, current_version: int, now: float) -> bool:
        """Queue a sample for training; False (and counted) when it is a duplicate, below the supervised threshold,
        stale or carries no signal."""
        if sample.transition_id in self.seen or sample.transition_id in self._queued:
            self.counts.duplicate += 1
            return False
        if self.min_reward is not None:
            if sample.rollout_reward < self.min_reward:
                self.counts.below_threshold += 1
                self._skip(sample)
                return False
            sample = supervised(sample)
        self._mark_stale_groups((sample,), current_version)
        if self._stale(sample, current_version):
            self.counts.stale += 1
            return False
        if self.skip_zero_advantage and sample.advantage == 0.0:
            self.counts.uninformative += 1
            self._skip(sample)
            return False
        self._queue.append((now, sample, self._skipped))
        self._skipped = 0
        self._queued.add(sample.transition_id)
        return True

    def _skip(self, sample: Sample) -> None:
        """Remember a sample not trained on; it counts toward the next batch (``count_skipped``) as a flat one does."""
        self.seen.add(sample.transition_id)
        self.counts.skipped_rewards.append(sample.reward)
        self._skipped += 1
        if not self._queue and self._skipped >= self.batch_transitions:
            self._skipped = 0  # a batch's worth with no signal at all: nothing to step on, start the next one

    def pending_positions(self) -> Iterable[tuple[str, int, int]]:
        """Kafka positions of the queued samples (not yet trained, so not yet committable)."""
        return (sample.position for _, sample, _ in self._queue if sample.position is not None)

    def ready(self, now: float) -> bool:
        """Whether a batch should be taken now: the budget or the count is reached, or the oldest waited long enough
        (a queue headed by samples trained by likelihood, demonstrations or the supervised objective's successes,
        which never go stale: once the newest has)."""
        if not self._queue:
            return False
        oldest, head, _ = self._queue[0]
        waiting_since = self._queue[-1][0] if head.demonstration else oldest
        if self.batch_wait_s and now - waiting_since >= self.batch_wait_s:
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
        taken = [self._queue.popleft() for _ in range(self._fits())]
        self._mark_stale_groups((sample for _, sample, _ in taken), current_version)  # before any is judged
        for _, sample, skipped in taken:
            room -= 1 + (skipped if self.count_skipped else 0)
            self._queued.discard(sample.transition_id)
            if self._stale(sample, current_version):
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

    def _past_bound(self, sample: Sample, current_version: int) -> bool:
        return not sample.demonstration and current_version - sample.policy_version > self.max_policy_lag

    def _mark_stale_groups(self, samples: Iterable[Sample], current_version: int) -> None:
        """Remember the groups of the ``samples`` past the lag bound: the rest of each group is stale with them."""
        for sample in samples:
            if sample.group_id is not None and self._past_bound(sample, current_version):
                self._stale_groups.add(sample.group_id)

    def _stale(self, sample: Sample, current_version: int) -> bool:
        """Whether ``sample`` is past the lag bound or in a group with a sample past it (``_mark_stale_groups``)."""
        if sample.demonstration:
            return False
        return self._past_bound(sample, current_version) or (
            sample.group_id is not None and sample.group_id in self._stale_groups)

    def _fits(self) -> int:
        """How many queued samples, from the front, fit one batch (at least one, however long it is).

        The count may run past ``batch_transitions`` to the end of a group: a group's advantages are
        centred on its own mean, and a step that took its successes without its failures (or the
        reverse) would push every sample of that step one way.
        """
        longest = counted = 0
        group: str | None = None
        for count, (_, sample, skipped) in enumerate(self._queue, start=1):
            longest = max(longest, sample.length)
            counted += 1 + (skipped if self.count_skipped else 0)
            in_group = sample.group_id is not None and sample.group_id == group
            if count > 1 and self.batch_transitions and counted > self.batch_transitions and not in_group:
                return count - 1
            if self.batch_tokens and count * longest > self.batch_tokens and count > 1:
                return count - 1
            group = sample.group_id
        return len(self._queue)


Weighted = tuple[Sample, float]
"""A sample and the loss weight of each of its trained tokens."""


def token_weights(samples: list[Sample], normalization: str) -> list[float]:
    """Per sample, the loss weight of each of its trained tokens, so that a step's weights sum to 1.

    ``token``: 1/N over the step's N trained tokens; ``transition``: 1/(n·S) for a sample of n
    trained tokens among S samples; ``rollout``: 1/(n_r·R) where n_r counts the trained tokens of
    the sample's rollout in this step and R the rollouts (``trainer/loss.py``).
    """
    counts = [s.trained_tokens for s in samples]
    if normalization == "token":
        return [1.0 / sum(counts)] * len(samples)
    if normalization == "transition":
        return [1.0 / (n * len(samples)) for n in counts]
    if normalization == "rollout":
        per_rollout: dict[str, int] = {}
        for sample, n in zip(samples, counts, strict=True):
            per_rollout[sample.rollout_id] = per_rollout.get(sample.rollout_id, 0) + n
        return [1.0 / (per_rollout[s.rollout_id] * len(per_rollout)) for s in samples]
    raise TrainerConfigError(f"unknown loss normalization {normalization!r} (token, transition or rollout)")


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors of some samples: inputs, and per predicted position the target, masks and behaviour logprobs.

    Sequences are right-padded. Column c of ``targets``/``response_mask``/``behaviour_logprobs``/
    ``weights`` is the token at position ``first + c + 1``, predicted by the logits at ``first + c``;
    ``first`` is the last position of the shortest prompt, so no column lies wholly inside the
    prompts and the model only has to compute logits (the costly vocabulary projection) for the
    last ``L - first`` positions. ``response_mask`` is true at trained tokens only (a sample's loss
    mask applied); ``weights`` are their loss weights (``token_weights``), 0 elsewhere.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L - 1 - first]
    response_mask: torch.Tensor  # [B, L - 1 - first]
    behaviour_logprobs: torch.Tensor  # [B, L - 1 - first]
    advantages: torch.Tensor  # [B]
    weights: torch.Tensor  # [B, L - 1 - first]
    likelihood: torch.Tensor  # [B] bool: a demonstration, trained by likelihood
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
    predicted by the hidden state at ``predictors[r, c]`` of that row. Rows are right-padded. A
    trajectory sample's response holds its masked tokens (tool results) too: they are in the row
    as inputs, false in ``response_mask``.
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
    weights: torch.Tensor  # [B, Lr]
    likelihood: torch.Tensor  # [B] bool

    @property
    def targets(self) -> torch.Tensor:
        return self.response_ids


def collate(samples: list[Sample], pad_id: int, device: torch.device | str, micro_batches: int = 1,
            row_tokens: int = PACKED_ROW_TOKENS, *, micro_batch_tokens: int = 0,
            normalization: str = "token", weights: list[float] | None = None) -> list[MicroBatch | PackedMicroBatch]:
    """Split one step's samples into padded micro-batches; a micro-batch whose samples repeat a prompt is packed.

    Samples are sorted by length (to waste little padding), or, when prompts repeat, by prompt so
    that a group's samples land in the same micro-batch. They are cut into ``micro_batches`` equal
    chunks, and, with ``micro_batch_tokens``, each chunk further so that it holds at most that many
    padded tokens (samples × the longest of them; a longer sample goes alone). A packed row takes
    responses to its prompt while it stays within ``row_tokens``; the next starts a new row with
    the prompt again. Token weights are computed over all the samples, so the micro-batches' losses
    sum to the step's loss; ``weights`` (one per sample) replaces them where the step is larger than
    these samples, as a rank's shard of a step is (``trainer/distributed.py``).
    """
    if weights is None:
        weights = token_weights(samples, normalization)
    weighted = list(zip(samples, weights, strict=True))
    shared = len({tuple(s.prompt_ids) for s in samples}) < len(samples)
    ordered = sorted(weighted, key=(lambda p: (len(p[0].prompt_ids), p[0].prompt_ids, len(p[0].response_ids)))
                     if shared else (lambda p: p[0].length))
    size = -(-len(ordered) // micro_batches)
    chunks = [piece for i in range(0, len(ordered), size)
              for piece in _within_tokens(ordered[i:i + size], micro_batch_tokens)]
    return [_pack(chunk, pad_id, device, row_tokens) if len({tuple(s.prompt_ids) for s, _ in chunk}) < len(chunk)
            else _pad(chunk, pad_id, device) for chunk in chunks]


def _within_tokens(samples: list[Weighted], budget: int) -> list[list[Weighted]]:
    """Consecutive runs of samples of at most ``budget`` padded tokens each (0: one run); a longer one alone."""
    if not budget:
        return [samples]
    runs: list[list[Weighted]] = []
    longest = 0
    for pair in samples:
        if runs and (len(runs[-1]) + 1) * max(longest, pair[0].length) <= budget:
            runs[-1].append(pair)
            longest = max(longest, pair[0].length)
        else:
            runs.append([pair])
            longest = pair[0].length
    return runs


def _trained_row(sample: Sample, weight: float) -> tuple[torch.Tensor | bool, torch.Tensor, torch.Tensor | float]:
    """A sample's response mask, behaviour logprobs (0 where not trained: never read) and token weights.

    A one-call sample (no mask, a behaviour policy) gives scalars for its mask and weight, as
    collation did before loss masks: the transition-level path does no more work than it did.
    """
    if not sample.loss_mask and not sample.demonstration:
        return True, torch.tensor(sample.behaviour_logprobs, dtype=torch.float32), weight
    mask = torch.tensor(sample.trained, dtype=torch.bool)
    behaviour = torch.zeros(len(sample.response_ids), dtype=torch.float32)
    if not sample.demonstration:
        behaviour[mask] = torch.tensor(sample.behaviour_logprobs, dtype=torch.float32)[mask]
    return mask, behaviour, mask * weight


def _pad(weighted: list[Weighted], pad_id: int, device: torch.device | str) -> MicroBatch:
    samples = [sample for sample, _ in weighted]
    length = max(s.length for s in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), length), dtype=torch.long)
    response_mask = torch.zeros((len(samples), length - 1), dtype=torch.bool)
    behaviour = torch.zeros((len(samples), length - 1), dtype=torch.float32)
    token_weight = torch.zeros((len(samples), length - 1), dtype=torch.float32)
    for row, (sample, weight) in enumerate(weighted):
        prompt, response = len(sample.prompt_ids), len(sample.response_ids)
        input_ids[row, :sample.length] = torch.tensor(sample.prompt_ids + sample.response_ids)
        attention[row, :sample.length] = 1
        columns = slice(prompt - 1, prompt - 1 + response)
        response_mask[row, columns], behaviour[row, columns], token_weight[row, columns] = _trained_row(sample, weight)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    likelihood = torch.tensor([s.demonstration for s in samples], dtype=torch.bool)
    first = min(len(s.prompt_ids) for s in samples) - 1
    return MicroBatch(input_ids.to(device), attention.to(device), input_ids[:, first + 1:].to(device),
                      response_mask[:, first:].to(device), behaviour[:, first:].to(device), advantages.to(device),
                      token_weight[:, first:].to(device), likelihood.to(device), first)


def _pack(weighted: list[Weighted], pad_id: int, device: torch.device | str, row_tokens: int) -> PackedMicroBatch:
    rows: list[tuple[list[int], list[Weighted]]] = []  # a prompt and the responses after it in one row
    open_rows: dict[tuple[int, ...], int] = {}
    for sample, weight in weighted:
        prompt_key = tuple(sample.prompt_ids)
        number = open_rows.get(prompt_key)
        if number is None or len(rows[number][0]) + len(sample.response_ids) > row_tokens:
            open_rows[prompt_key], number = len(rows), len(rows)
            rows.append((list(sample.prompt_ids), []))
        rows[number][0].extend(sample.response_ids)
        rows[number][1].append((sample, weight))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)  # 0: the prompt, k: the k-th response, -1: pad
    ordered: list[Weighted] = []
    row_of: list[int] = []
    starts: list[int] = []
    for number, (ids, members) in enumerate(rows):
        prompt = len(members[0][0].prompt_ids)
        input_ids[number, :len(ids)] = torch.tensor(ids)
        positions[number, :prompt] = torch.arange(prompt)
        segments[number, :prompt] = 0
        start = prompt
        for k, (sample, weight) in enumerate(members, start=1):
            end = start + len(sample.response_ids)
            positions[number, start:end] = torch.arange(prompt, prompt + len(sample.response_ids))
            segments[number, start:end] = k
            ordered.append((sample, weight))
            row_of.append(number)
            starts.append(start)
            start = end
    index = torch.arange(width)
    query, key = segments[:, :, None], segments[:, None, :]  # each position's segment, as query and as key
    attends = (index[:, None] >= index[None, :]) & (query >= 0) & (key >= 0) & ((key == 0) | (key == query))
    attends |= torch.eye(width, dtype=torch.bool)  # a pad attends to itself: no row of the softmax is empty
    length = max(len(s.response_ids) for s, _ in ordered)
    predictors = torch.zeros((len(ordered), length), dtype=torch.long)
    response_ids = torch.full((len(ordered), length), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(ordered), length), dtype=torch.bool)
    behaviour = torch.zeros((len(ordered), length), dtype=torch.float32)
    token_weight = torch.zeros((len(ordered), length), dtype=torch.float32)
    for row, ((sample, weight), start) in enumerate(zip(ordered, starts, strict=True)):
        count = len(sample.response_ids)
        predictors[row, 0] = len(sample.prompt_ids) - 1  # the prompt's last position predicts the first token
        predictors[row, 1:count] = torch.arange(start, start + count - 1)
        response_ids[row, :count] = torch.tensor(sample.response_ids)
        response_mask[row, :count], behaviour[row, :count], token_weight[row, :count] = _trained_row(sample, weight)
    advantages = torch.tensor([s.advantage for s, _ in ordered], dtype=torch.float32)
    likelihood = torch.tensor([s.demonstration for s, _ in ordered], dtype=torch.bool)
    return PackedMicroBatch(input_ids.to(device), positions.to(device), attends.to(device),
                            torch.tensor(row_of, dtype=torch.long, device=device), predictors.to(device),
                            response_ids.to(device), response_mask.to(device), behaviour.to(device),
                            advantages.to(device), token_weight.to(device), likelihood.to(device))

"""Batching: transition records checked, duplicates, stale and flat ones dropped, batches closed, collation;
trajectory-level samples with their loss masks, demonstrations, token weights and micro-batch budgets."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from agentstream.infra.config import ConfigError, TrainerConfig
from agentstream.schemas import TRANSITION, AvroCodec
from agentstream.trainer.batching import (
    Batcher,
    MicroBatch,
    NonFiniteTransition,
    PackedMicroBatch,
    Sample,
    SeenIds,
    TransitionError,
    collate,
    token_weights,
)
from agentstream.trainer.errors import TrainerConfigError
from agentstream.trainer.loss import TokenStats
from agentstream.trainer.metrics import StepReport
from agentstream.trainer.step import StepResult
from tests.support.samples import CALL_1, CALL_2, MASK, PROMPT, TOOL, record


def sample(tid: str, version: int = 0, prompt: int = 3, response: int = 2, advantage: float = 1.0,
           position=None, group: str | None = None) -> Sample:
    return Sample(tid, "r", version, list(range(10, 10 + prompt)), list(range(50, 50 + response)),
                  [-0.5] * response, 1.0, advantage, position, group_id=group)


def batcher(**overrides) -> Batcher:
    options = {"batch_tokens": 0, "batch_transitions": 4, "batch_wait_s": 0, "max_policy_lag": 2,
               "skip_zero_advantage": True, "seen": SeenIds(100)}
    options.update(overrides)
    return Batcher(**options)


def test_transition_records_are_checked():
    record = {"transition_id": "t", "rollout_id": "r", "policy_version": 1, "prompt_token_ids": [1],
              "response_token_ids": [2, 3], "behaviour_logprobs": [-0.1], "reward": 1.0, "advantage": 0.5}
    with pytest.raises(TransitionError, match="1 logprobs for 2"):
        Sample.from_record(record)
    with pytest.raises(TransitionError, match="no prompt"):
        Sample.from_record({**record, "prompt_token_ids": []})
    assert Sample.from_record({**record, "behaviour_logprobs": [-0.1, -0.2]}, ("t", 0, 7)).position == ("t", 0, 7)


def test_duplicates_stale_and_flat_transitions_are_dropped_and_counted():
    b = batcher()
    assert b.offer(sample("a"), current_version=1, now=0)
    assert not b.offer(sample("a"), current_version=1, now=0)  # queued already
    assert not b.offer(sample("old", version=0), current_version=3, now=0)  # lag 3 > 2
    assert not b.offer(sample("flat", advantage=0.0), current_version=1, now=0)
    assert b.offer(sample("b", version=1), current_version=1, now=0)
    batch = b.take(current_version=3)  # "a" (lag 3) went stale while it waited
    assert [s.transition_id for s in batch.samples] == ["b"]
    assert (batch.counts.duplicate, batch.counts.stale, batch.counts.uninformative) == (1, 2, 1)
    assert batch.lags() == [2]
    assert not b.offer(sample("b", version=1), current_version=3, now=0)  # trained already
    assert b.counts.duplicate == 1


def test_batches_close_on_count_token_budget_or_wait():
    b = batcher(batch_transitions=3)
    for name in "abc":
        b.offer(sample(name), 0, now=0)
    assert b.ready(now=0) and len(b.take(0).samples) == 3
    b = batcher(batch_transitions=0, batch_tokens=20)  # padded size = count x longest (5 tokens each)
    for name in "abcde":
        b.offer(sample(name), 0, now=0)
    assert b.ready(now=0) and len(b.take(0).samples) == 4
    assert not b.ready(now=0)
    b.offer(sample("long", prompt=30), 0, now=0)  # alone over budget: still taken, alone, after the queued one
    assert [len(b.take(0).samples), len(b.take(0).samples)] == [1, 1]
    b = batcher(batch_transitions=10, batch_wait_s=2.0)
    b.offer(sample("a"), 0, now=10.0)
    assert not b.ready(now=11.0) and b.ready(now=12.0)


def test_a_warm_start_steps_on_full_batches_of_demonstrations_however_slowly_they_arrive():
    """Seen on 2026-12-02: 224 demonstrations made steps of 32, 9, 13, 32, 32, 32, 32, 32 and 10 where a step
    outlasted the 120 s wait, as each leftover closed on the age of its oldest."""
    demo = batcher(batch_transitions=32, batch_wait_s=120.0)
    sizes, sent, clock = [], 0, 0.0
    for arriving in (41, 13, 30, 60, 50, 30):  # published while steps of 150 s ran
        for _ in range(arriving):
            demo.offer(replace(sample(f"d{sent}"), behaviour_logprobs=[]), 0, now=clock)
            sent += 1
        clock += 150.0
        while demo.ready(now=clock - 100.0):  # read 100 s after the newest was published: still coming
            sizes.append(len(demo.take(0).samples))
    assert sent == 224 and sizes == [32] * 7 and not len(demo)
    for name in ("tail1", "tail2"):  # a count that is not a multiple of the batch: the rest closes once they stop
        demo.offer(replace(sample(name), behaviour_logprobs=[]), 0, now=clock)
    assert not demo.ready(now=clock + 119.0) and demo.ready(now=clock + 120.0) and len(demo.take(0).samples) == 2
    rollouts = batcher(batch_transitions=32, batch_wait_s=120.0)  # sampled ones close on the oldest's age
    rollouts.offer(sample("old"), 0, now=0.0)
    rollouts.offer(sample("new"), 0, now=100.0)
    assert rollouts.ready(now=120.0)


def test_skipped_flat_transitions_count_toward_the_batch_when_asked():
    counting, plain = batcher(batch_transitions=4, count_skipped=True), batcher(batch_transitions=4)
    for b in (counting, plain):
        b.offer(sample("a"), 0, now=0)
        b.offer(sample("flat1", advantage=0.0), 0, now=0)
        b.offer(sample("flat2", advantage=0.0), 0, now=0)
        b.offer(sample("b"), 0, now=0)
    assert counting.ready(now=0) and not plain.ready(now=0)
    batch = counting.take(0)
    assert [s.transition_id for s in batch.samples] == ["a", "b"] and batch.counts.uninformative == 2
    for name in ("f3", "f4", "f5", "f6"):  # a batch's worth with no signal: nothing to take, and it is not carried
        counting.offer(sample(name, advantage=0.0), 0, now=0)
    counting.offer(sample("c"), 0, now=0)
    assert not counting.ready(now=0)


def test_supervised_rejections_count_toward_the_batch_as_flat_ones_do():
    b = batcher(min_reward=1.0, batch_transitions=4, count_skipped=True)
    b.offer(Sample.from_record(record(transition_id="good", advantage=0.0)), current_version=0, now=0)
    for name in ("bad1", "bad2"):
        b.offer(Sample.from_record(record(transition_id=name, reward=0.0, return_value=0.0)), current_version=0, now=0)
    assert not b.ready(now=0)  # three of the wave's four
    b.offer(Sample.from_record(record(transition_id="bad3", reward=0.0, return_value=0.0)), current_version=0, now=0)
    assert b.ready(now=0)  # a wave with one success steps on it, as a wave with one informative group does
    batch = b.take(current_version=0)
    assert [s.transition_id for s in batch.samples] == ["good"] and batch.counts.below_threshold == 3


def test_a_backlog_of_rounds_is_cut_where_each_round_ends_when_skipped_ones_count():
    b = batcher(batch_transitions=4, count_skipped=True)
    rounds = [["a1", "flat", "a2", "flat"], ["flat", "flat", "b1", "b2"], ["c1", "c2", "c3", "c4"], ["flat"] * 3]
    for round_ in rounds:  # three rounds of four arrive while the trainer is busy
        for index, name in enumerate(round_):
            b.offer(sample(f"{name}{index}{len(b)}", advantage=0.0 if name == "flat" else 1.0), 0, now=0)
    taken = []
    while b.ready(now=0):
        taken.append([s.transition_id[:2] for s in b.take(0).samples])
    assert taken == [["a1", "a2"], ["b1", "b2"], ["c1", "c2", "c3", "c4"]]  # not [a1 a2 b1 b2], [c1 c2 c3 c4]
    b.offer(sample("d1"), 0, now=0)  # the last round's three flat ones count with it
    assert b.ready(now=0) and [s.transition_id for s in b.take(0).samples] == ["d1"]
    assert not b.ready(now=0)


def test_the_count_never_splits_a_group_across_steps():
    b = batcher(batch_transitions=4, count_skipped=True)
    for name in ("flat1", "flat2"):  # a group cut short by its timeout: two flat ones, not a wave's four
        b.offer(sample(name, advantage=0.0, group="f"), 0, now=0)
    for name, advantage in (("g1", 0.8), ("g2", 0.8), ("g3", -0.8), ("g4", -0.8)):
        b.offer(sample(name, advantage=advantage, group="g"), 0, now=0)
    b.offer(sample("h1", group="h"), 0, now=0)
    batch = b.take(0)
    assert [s.transition_id for s in batch.samples] == ["g1", "g2", "g3", "g4"]  # the count ended at g2
    assert sum(s.advantage for s in batch.samples) == pytest.approx(0.0)
    assert [s.transition_id for s in b.take(0).samples] == ["h1"]


def test_a_group_with_a_stale_sample_is_dropped_whole():
    b = batcher(batch_transitions=8)
    b.offer(sample("g-fresh", version=2, advantage=-0.6, group="g"), current_version=2, now=0)
    b.offer(sample("h1", version=2, group="h"), current_version=2, now=0)
    b.offer(sample("h2", version=2, advantage=-1.0, group="h"), current_version=2, now=0)
    assert not b.offer(sample("g-old", version=1, advantage=1.7, group="g"), current_version=4, now=0)  # lag 3
    assert not b.offer(sample("g-late", version=2, advantage=-0.6, group="g"), current_version=4, now=0)
    batch = b.take(current_version=4)
    assert [s.transition_id for s in batch.samples] == ["h1", "h2"]  # g's fresh ones went with its stale one
    assert batch.counts.stale == 3


def test_a_stale_sample_takes_its_groups_earlier_ones_in_the_same_batch():
    b = batcher(batch_transitions=8)
    for name, version in (("g1", 3), ("g2", 3), ("g3", 2)):  # a rollout's calls spanned a hot swap
        b.offer(sample(name, version=version, group="g"), current_version=3, now=0)
    b.offer(sample("u", version=3), current_version=3, now=0)  # no group: judged alone
    batch = b.take(current_version=5)  # g3's lag is 3
    assert [s.transition_id for s in batch.samples] == ["u"] and batch.counts.stale == 3


def test_a_transition_record_names_its_group():
    assert Sample.from_record(record(group_id="g-7")).group_id == "g-7"
    assert Sample.from_record(record()).group_id is None


def test_pending_positions_hold_back_commits():
    b = batcher()
    b.offer(sample("a", position=("t", 0, 5)), 0, now=0)
    b.offer(sample("b", position=("t", 1, 9)), 0, now=0)
    assert sorted(b.pending_positions()) == [("t", 0, 5), ("t", 1, 9)]
    b.take(0)
    assert list(b.pending_positions()) == []


def test_collate_right_pads_and_aligns_targets_with_response_tokens():
    short, long = sample("s", prompt=2, response=1), sample("l", prompt=3, response=3)
    micro, = collate([long, short], pad_id=0, device="cpu")
    assert micro.input_ids.tolist() == [[10, 11, 50, 0, 0, 0], [10, 11, 12, 50, 51, 52]]
    assert micro.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    # column c predicts the token at first + c + 1; first is the shortest prompt's last position
    assert micro.first == 1 and micro.logits_to_keep == 5
    assert micro.response_mask.tolist() == [[True, False, False, False],
                                            [False, True, True, True]]
    assert micro.targets[micro.response_mask].tolist() == [50, 50, 51, 52]
    assert micro.behaviour_logprobs[micro.response_mask].tolist() == [-0.5] * 4
    assert [m.input_ids.shape[0] for m in collate([long, short, long], 0, "cpu", micro_batches=2)] == [2, 1]


def test_collate_packs_a_repeated_prompt_once_per_row_with_each_response_after_it():
    group = [replace(sample(f"g{i}", prompt=3, response=1 + i), response_ids=[60 + i] * (1 + i)) for i in range(3)]
    alone = sample("a", prompt=2, response=2)
    micro, = collate([group[2], alone, group[0], group[1]], pad_id=0, device="cpu")
    assert isinstance(micro, PackedMicroBatch)
    assert micro.input_ids.tolist() == [[10, 11, 50, 51, 0, 0, 0, 0, 0], [10, 11, 12, 60, 61, 61, 62, 62, 62]]
    # each response continues its prompt's positions
    assert micro.position_ids.tolist() == [[0, 1, 2, 3, 0, 0, 0, 0, 0], [0, 1, 2, 3, 3, 4, 3, 4, 5]]
    # the second token of response 61 sees the prompt and its own first token, not response 60
    assert micro.attends[1, 5].tolist() == [True, True, True, False, True, True, False, False, False]
    assert micro.attends[1, 2].tolist() == [True, True, True] + [False] * 6  # the prompt is causal
    assert micro.attends[0, 6].tolist() == [False] * 6 + [True, False, False]  # a pad sees only itself
    assert micro.row_of.tolist() == [0, 1, 1, 1]
    # column 0 is predicted by the prompt's last position, column c by the response's token c - 1
    assert micro.predictors[micro.response_mask].tolist() == [1, 2, 2, 2, 4, 2, 6, 7]
    assert micro.targets.tolist() == [[50, 51, 0], [60, 0, 0], [61, 61, 0], [62, 62, 62]]
    assert micro.behaviour_logprobs[micro.response_mask].tolist() == [-0.5] * 8
    two = collate([*group, alone], 0, "cpu", micro_batches=2)  # a group stays together: sorted by prompt
    assert [type(m).__name__ for m in two] == ["MicroBatch", "PackedMicroBatch"]
    split, = collate(group, 0, "cpu", row_tokens=6)  # the third response would make the row 9 tokens long
    assert split.input_ids.tolist() == [[10, 11, 12, 60, 61, 61], [10, 11, 12, 62, 62, 62]]
    assert split.row_of.tolist() == [0, 0, 1] and split.predictors[2].tolist() == [2, 3, 4]


# ---------------------------------------------------------------- trajectory-level samples


OLD_TRANSITION_SCHEMA = Path(__file__).parents[3] / "schemas" / "avro" / "history" / "transition.571826264.avsc"


def test_trajectory_records_carry_their_mask_calls_and_break_and_old_records_read_as_one_call():
    sample = Sample.from_record(record())
    assert (sample.loss_mask, sample.merged_calls, sample.split_at_break) == (MASK, 2, True)
    assert sample.trained_tokens == 7 and not sample.demonstration
    # a record written with the schema before the loss mask decodes without those fields
    codec = AvroCodec()
    old_schema = json.loads(OLD_TRANSITION_SCHEMA.read_text())
    old = {key: value for key, value in record().items() if key not in ("loss_mask", "merged_calls", "split_at_break")}
    old.update(response_token_ids=CALL_1, behaviour_logprobs=[-1.0] * 4, span_id="s", agent_name="a", model="m",
               step_index=0, return_value=1.0, group_id=None, created_at_us=0)
    name, decoded = codec.decode(codec.encode(old_schema, old))
    assert name.endswith(TRANSITION) and "loss_mask" not in decoded
    plain = Sample.from_record(decoded)
    assert (plain.loss_mask, plain.merged_calls, plain.split_at_break, plain.trained) == ((), 1, False, [True] * 4)


def test_bad_masks_and_demonstrations_with_no_positive_advantage_are_refused():
    with pytest.raises(TransitionError, match="loss mask of 3 for 10"):
        Sample.from_record(record(loss_mask=[True, False, True]))
    with pytest.raises(TransitionError, match="trains no token"):
        Sample.from_record(record(loss_mask=[False] * 10))
    with pytest.raises(TransitionError, match="9 logprobs for 10"):
        Sample.from_record(record(behaviour_logprobs=[-1.0] * 9))
    for advantage in (0.0, -0.5):
        with pytest.raises(TransitionError, match="demonstration"):
            Sample.from_record(record(behaviour_logprobs=[], advantage=advantage))
    demonstration = Sample.from_record(record(behaviour_logprobs=[]))
    assert demonstration.demonstration and demonstration.trained_tokens == 7
    # a masked token's behaviour logprob is never read; a trained one's must be finite
    garbage = [-1.0] * 4 + [math.nan, math.inf, 1e30] + [-2.0] * 3
    assert Sample.from_record(record(behaviour_logprobs=garbage)).behaviour_logprobs[4:7][1] == math.inf
    with pytest.raises(NonFiniteTransition, match="nan"):
        Sample.from_record(record(behaviour_logprobs=[math.nan, *garbage[1:]]))


def test_a_demonstration_never_goes_stale_a_sampled_trajectory_does():
    batcher = Batcher(batch_tokens=0, batch_transitions=4, batch_wait_s=0, max_policy_lag=1,
                      skip_zero_advantage=True, seen=SeenIds(10))
    assert batcher.offer(Sample.from_record(record(transition_id="demo", behaviour_logprobs=[])), 5, now=0)
    assert not batcher.offer(Sample.from_record(record(transition_id="sampled")), 5, now=0)
    assert batcher.offer(Sample.from_record(record(transition_id="fresh", policy_version=4)), 4, now=0)
    batch = batcher.take(current_version=9)  # "fresh" went stale while it waited; the demonstration did not
    assert [s.transition_id for s in batch.samples] == ["demo"] and batch.counts.stale == 2
    report = StepReport.of("m", 1, batch, StepResult(TokenStats(tokens=7), 0.1, 1.0, 1, 16, 0.5))
    assert (report.staleness_mean, report.staleness_max) == (0.0, 0)  # nothing here lags behind a behaviour policy


def test_collation_puts_the_loss_mask_into_the_response_mask_padded_and_packed():
    merged = Sample.from_record(record())
    micro, = collate([merged, Sample.from_record(record(transition_id="u", prompt_token_ids=[3, 4]))], 0, "cpu")
    assert isinstance(micro, MicroBatch)
    row = micro.response_mask[1]  # the longer prompt's row: its response starts at column len(PROMPT) - 2
    assert row.tolist() == [False] * 4 + list(MASK)
    assert micro.behaviour_logprobs[1].tolist() == [0.0] * 4 + [-1.0] * 4 + [0.0] * 3 + [-2.0] * 3
    assert micro.targets[1, 4:].tolist() == CALL_1 + TOOL + CALL_2  # the tool result is in the inputs all the same
    assert micro.weights.sum().item() == pytest.approx(1.0) and (micro.weights[~micro.response_mask] == 0).all()
    group = [replace(merged, transition_id=f"g{i}", response_ids=[t + i for t in merged.response_ids])
             for i in range(3)]
    packed, = collate(group, 0, "cpu")
    assert isinstance(packed, PackedMicroBatch)
    assert packed.input_ids[0].tolist() == PROMPT + [t for s in group for t in s.response_ids]
    assert packed.response_mask.tolist() == [list(MASK)] * 3
    assert packed.weights[packed.response_mask].tolist() == pytest.approx([1 / 21] * 21)
    assert packed.behaviour_logprobs[~packed.response_mask].abs().sum() == 0


def test_token_weights_for_each_normalization_by_hand():
    a = Sample("a", "r1", 0, [1], [2, 3], [-1.0] * 2, 1.0, 1.0)
    b = Sample("b", "r1", 0, [1], [2, 3, 4, 5], [-1.0] * 4, 1.0, 1.0, loss_mask=(True, False, True, True))
    c = Sample("c", "r2", 0, [1], [2, 3, 4, 5], [-1.0] * 4, 1.0, 1.0)
    assert token_weights([a, b, c], "token") == pytest.approx([1 / 9] * 3)
    assert token_weights([a, b, c], "transition") == pytest.approx([1 / 6, 1 / 9, 1 / 12])
    assert token_weights([a, b, c], "rollout") == pytest.approx([1 / 10, 1 / 10, 1 / 8])  # r1: 5 tokens, r2: 4
    for normalization in ("token", "transition", "rollout"):
        weights = token_weights([a, b, c], normalization)
        assert sum(w * s.trained_tokens for w, s in zip(weights, [a, b, c], strict=True)) == pytest.approx(1.0)
    with pytest.raises(TrainerConfigError, match="unknown loss normalization"):
        token_weights([a], "sequence")


def test_micro_batch_tokens_cut_micro_batches_to_a_padded_token_budget_a_longer_sample_alone():
    lengths = [10, 20, 30, 40, 100]
    samples = [Sample(f"s{n}", "r", 0, [n] * 5, [2] * (n - 5), [-1.0] * (n - 5), 1.0, 1.0) for n in lengths]
    micros = collate(samples, 0, "cpu", micro_batch_tokens=60)
    assert [m.input_ids.shape for m in micros] == [(2, 20), (1, 30), (1, 40), (1, 100)]
    assert [m.input_ids.shape[0] for m in collate(samples, 0, "cpu", 2, micro_batch_tokens=90)] == [3, 1, 1]
    assert len(collate(samples, 0, "cpu")) == 1  # 0: off, as before
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        TrainerConfig(micro_batch_tokens=-1)


def test_supervised_selection_keeps_good_rollouts_whatever_their_advantage_and_counts_the_others():
    b = batcher(min_reward=1.0, batch_transitions=8)
    flat_success = Sample.from_record(record(transition_id="flat", advantage=0.0))  # a group where every one succeeded
    early_call = Sample.from_record(record(transition_id="early", reward=0.0, return_value=1.0, advantage=0.0))
    failed = Sample.from_record(record(transition_id="failed", reward=0.0, return_value=0.0, advantage=-1.0))
    old = replace(sample("old", version=0, advantage=-0.5), reward=2.0)  # from memory: the reward is its return
    assert [b.offer(s, current_version=9, now=0) for s in (flat_success, early_call, failed, old)] == [
        True, True, False, True]
    assert not b.offer(failed, current_version=9, now=0)  # remembered: a replay is a duplicate, not counted twice
    batch = b.take(current_version=9)
    assert [s.transition_id for s in batch.samples] == ["flat", "early", "old"]  # none stale: no ratio to bound
    assert all(s.demonstration and s.advantage == 1.0 for s in batch.samples)
    assert [s.loss_mask for s in batch.samples[:2]] == [MASK, MASK]  # the RL loss mask, unchanged
    assert batch.counts.below_threshold == 1 and batch.counts.duplicate == 1
    assert sorted(batch.rewards()) == [0.0, 0.0, 1.0, 2.0]  # the reward mean covers the rejected one too
    report = StepReport.of("m", 1, batch, StepResult(TokenStats(tokens=3), 0.5, 1.0, 3, 30, 0.1))
    assert report.below_threshold == 1 and "below threshold 1 " in report.line()


def test_without_a_threshold_samples_keep_their_advantages_and_a_nan_return_is_refused():
    b = batcher()
    assert not b.offer(Sample.from_record(record(transition_id="flat", advantage=0.0)), current_version=0, now=0)
    assert b.offer(Sample.from_record(record(transition_id="low", return_value=0.0)), current_version=0, now=0)
    assert b.take(current_version=0).samples[0].advantage == 0.5
    with pytest.raises(NonFiniteTransition, match="return nan"):
        Sample.from_record(record(return_value=math.nan))


def test_the_objective_and_its_threshold_are_validated():
    assert TrainerConfig(objective="supervised", supervised_min_reward=0.5).supervised_min_reward == 0.5
    with pytest.raises(ConfigError, match="objective must be policy_gradient or supervised"):
        TrainerConfig(objective="sft")
    with pytest.raises(ConfigError, match="supervised_min_reward must be a finite number"):
        TrainerConfig(supervised_min_reward=math.inf)

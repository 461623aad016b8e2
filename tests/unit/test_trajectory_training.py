"""The trainer on trajectory-level samples: loss masks, demonstrations, loss normalisation, micro-batch budgets."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from infra.config import ConfigError, TrainerConfig
from models import teacher_forced_logprobs
from schemas import TRANSITION, AvroCodec
from trainer.batching import (
    Batch,
    Batcher,
    Counts,
    MicroBatch,
    NonFiniteTransition,
    PackedMicroBatch,
    Sample,
    SeenIds,
    TransitionError,
    collate,
    token_weights,
)
from trainer.errors import TrainerConfigError
from trainer.loss import TokenStats, policy_loss
from trainer.metrics import TRAIN_STEP_COLUMNS, StepReport
from trainer.policy import build_policy
from trainer.step import StepResult, token_logprobs, train_step

PROMPT = [5, 6, 7, 8, 9, 10]
CALL_1, TOOL, CALL_2 = [40, 41, 42, 43], [90, 91, 92], [44, 45, 46]
OLD_TRANSITION_SCHEMA = Path(__file__).parents[2] / "schemas" / "avro" / "history" / "transition.571826264.avsc"
MASK = (True,) * len(CALL_1) + (False,) * len(TOOL) + (True,) * len(CALL_2)


def record(**overrides) -> dict:
    """A decoded Transition record of a two-call trajectory sample (prompt, call 1, tool result, call 2)."""
    values = {"transition_id": "t", "rollout_id": "r", "policy_version": 0, "prompt_token_ids": PROMPT,
              "response_token_ids": CALL_1 + TOOL + CALL_2, "behaviour_logprobs": [-1.0] * 4 + [0.0] * 3 + [-2.0] * 3,
              "loss_mask": list(MASK), "merged_calls": 2, "split_at_break": True, "reward": 1.0, "advantage": 0.5}
    return {**values, **overrides}


@pytest.fixture(scope="module")
def tiny_config() -> TrainerConfig:
    return TrainerConfig(model="tiny", lr=1e-3, threads=1, device="cpu", grad_clip=1e9)


def sgd_policy(config: TrainerConfig):
    policy = build_policy(config)
    policy.optimizer = torch.optim.SGD(policy.trainable(), lr=1.0)  # the update is the gradient itself
    return policy


def step_delta(config: TrainerConfig, samples: list[Sample]) -> tuple[torch.Tensor, StepResult]:
    """The parameter change of one SGD step (lr 1: minus the gradient) from the same initial weights."""
    policy = sgd_policy(config)
    before = [p.detach().clone() for p in policy.trainable()]
    result = train_step(policy, Batch(samples, 0, Counts()), config)
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(policy.trainable(), before, strict=True)]), result


def trajectory(policy, tid: str = "m", rollout: str = "r", advantage: float = 1.0, shift: int = 0,
               prompt: list[int] = PROMPT) -> Sample:
    """A merged two-call sample whose trained tokens' behaviour logprobs are the policy's own, nudged (ratio ≠ 1)."""
    call_1, call_2 = [t + shift for t in CALL_1], [t + shift for t in CALL_2]
    logprobs = teacher_forced_logprobs(policy.model, prompt, call_1 + TOOL + call_2, 1.0)
    behaviour = [value - 0.3 * ((i % 3) - 1) if kept else 0.0 for i, (value, kept) in enumerate(zip(logprobs, MASK,
                                                                                                      strict=True))]
    return Sample(tid, rollout, 0, list(prompt), call_1 + TOOL + call_2, behaviour, 1.0, advantage,
                  loss_mask=MASK, merged_calls=2)


# ---------------------------------------------------------------- records


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


# ---------------------------------------------------------------- collation


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


# ---------------------------------------------------------------- the loss


def test_masked_tokens_get_no_loss_no_gradient_and_a_merged_samples_advantage_reaches_every_generated_token():
    merged = Sample.from_record(record(advantage=0.5))
    micro, = collate([merged], 0, "cpu")
    logprobs = micro.behaviour_logprobs.clone().requires_grad_()  # ratio 1 at every trained token
    out = policy_loss(logprobs, micro.behaviour_logprobs, micro.advantages, micro.response_mask, weights=micro.weights,
                      likelihood=micro.likelihood)
    out.loss.backward()
    assert out.stats.tokens == 7 and out.loss.item() == pytest.approx(-0.5)
    # d loss / d logp_t = -A·ρ·w_t = -0.5/7 at each of both calls' tokens, 0 at the tool result's
    assert logprobs.grad[micro.response_mask].tolist() == pytest.approx([-0.5 / 7] * 7)
    assert (logprobs.grad[~micro.response_mask] == 0).all()
    # other tokens at the masked positions (their logprobs differ), garbage behaviour there: the same loss exactly
    changed = logprobs.detach().clone()
    changed[~micro.response_mask] = torch.rand(int((~micro.response_mask).sum())) * -30
    changed.requires_grad_()
    behaviour = micro.behaviour_logprobs.clone()
    behaviour[~micro.response_mask] = 1e30
    again = policy_loss(changed, behaviour, micro.advantages, micro.response_mask, weights=micro.weights)
    again.loss.backward()
    assert torch.equal(again.loss, out.loss) and again.stats == out.stats and torch.equal(changed.grad, logprobs.grad)


def test_a_trajectory_sample_trains_exactly_what_its_calls_would_and_ignores_what_lies_between(tiny_config):
    policy = build_policy(tiny_config)
    merged = trajectory(policy)
    response = merged.response_ids
    calls = [Sample("c1", "r", 0, PROMPT, response[:4], merged.behaviour_logprobs[:4], 1.0, 1.0),
             Sample("c2", "r", 0, PROMPT + response[:7], response[7:], merged.behaviour_logprobs[7:], 1.0, 1.0)]
    merged_delta, merged_result = step_delta(tiny_config, [merged])
    calls_delta, calls_result = step_delta(tiny_config, calls)
    assert merged_result.stats.tokens == calls_result.stats.tokens == 7
    assert merged_result.loss == pytest.approx(calls_result.loss, abs=1e-6)
    assert torch.allclose(merged_delta, calls_delta, atol=1e-6) and merged_delta.abs().max() > 0
    for name in ("pg_loss", "clipped", "importance_weight", "entropy"):
        assert getattr(merged_result.stats, name) == pytest.approx(getattr(calls_result.stats, name), abs=1e-4)
    # garbage behaviour logprobs where the mask is false, through the record: the very same step
    garbage = list(merged.behaviour_logprobs)
    garbage[4:7] = [math.nan, -math.inf, 1e30]
    fields = {"transition_id": "m", "rollout_id": "r", "policy_version": 0, "prompt_token_ids": PROMPT,
              "response_token_ids": response, "behaviour_logprobs": garbage, "loss_mask": list(MASK),
              "merged_calls": 2, "reward": 1.0, "advantage": 1.0}
    garbage_delta, garbage_result = step_delta(tiny_config, [Sample.from_record(fields)])
    assert torch.equal(garbage_delta, merged_delta) and garbage_result.loss == merged_result.loss
    assert garbage_result.stats == merged_result.stats


def test_a_step_on_demonstrations_raises_the_demonstrated_tokens_logprobs(tiny_config):
    policy = build_policy(replace(tiny_config, lr=1e-2))
    demonstrations = [Sample.from_record(record(transition_id=f"d{i}", behaviour_logprobs=[],
                                                response_token_ids=[t + i for t in CALL_1 + TOOL + CALL_2],
                                                advantage=1.0)) for i in range(3)]
    micro, = collate(demonstrations, policy.pad_id, "cpu")
    with torch.no_grad():
        before = token_logprobs(policy.model, micro, 1.0)[0][micro.response_mask]
    result = train_step(policy, Batch(demonstrations, 0, Counts()), replace(tiny_config, lr=1e-2))
    # the loss is -A·mean log π over the 21 trained tokens; no ratio, so nothing clipped and weight 1
    assert result.loss == pytest.approx(-float(before.mean()), rel=1e-4)
    assert result.stats.tokens == 21 and result.stats.clipped == 0 and result.stats.mean("importance_weight") == 1
    with torch.no_grad():
        after = token_logprobs(policy.model, micro, 1.0)[0][micro.response_mask]
    assert after.mean() > before.mean() + 0.05


# ---------------------------------------------------------------- normalisation and micro-batches


@pytest.mark.parametrize("normalization", ["token", "transition", "rollout"])
def test_accumulated_and_token_bounded_micro_batches_give_one_batchs_gradient(tiny_config, normalization):
    policy = build_policy(tiny_config)
    samples = [trajectory(policy, "a", "r1", 1.0), trajectory(policy, "b", "r1", -0.5, shift=3),
               trajectory(policy, "c", "r2", 2.0, shift=6, prompt=PROMPT[:3]),
               Sample("d", "r3", 0, [5, 6], [40, 41, 42, 43, 44, 45, 46, 47], [-4.0] * 8, 1.0, -1.0),
               Sample("e", "r3", 0, [5, 6, 7, 8, 9, 10, 11, 12, 13], [50], [-4.0], 1.0, 0.3),
               Sample.from_record(record(transition_id="f", rollout_id="r2", behaviour_logprobs=[], advantage=0.7))]
    config = replace(tiny_config, loss_normalization=normalization)
    one, _ = step_delta(config, samples)
    assert collate(samples, 0, "cpu", micro_batch_tokens=20)[0].input_ids.shape[0] == 1  # every sample alone
    for split in (replace(config, accumulation_steps=3), replace(config, micro_batch_tokens=20),
                  replace(config, accumulation_steps=2, micro_batch_tokens=40)):
        delta, _ = step_delta(split, samples)
        assert torch.allclose(delta, one, atol=1e-6)
    if normalization != "token":  # the setting changes the gradient
        assert not torch.allclose(step_delta(replace(config, loss_normalization="token"), samples)[0], one, atol=1e-4)


def test_a_packed_group_of_trajectories_and_a_demonstration_trains_as_each_sample_alone(tiny_config):
    policy = build_policy(tiny_config)
    group = [trajectory(policy, f"g{i}", f"r{i}", (-1.0) ** i * (1 + i), shift=2 * i) for i in range(3)]
    group.append(replace(trajectory(policy, "demo", "r9", 1.5, shift=7), behaviour_logprobs=[]))
    config = replace(tiny_config, loss_normalization="rollout")
    packed, = collate(group, policy.pad_id, "cpu")
    assert isinstance(packed, PackedMicroBatch) and packed.likelihood.tolist() == [False, False, False, True]
    together, result = step_delta(config, group)
    alone, _ = step_delta(replace(config, accumulation_steps=len(group)), group)  # one padded micro-batch each
    assert result.stats.tokens == 28
    assert torch.allclose(together, alone, atol=1e-6) and together.abs().max() > 0


# ---------------------------------------------------------------- metrics


def test_the_train_steps_row_counts_calls_per_sample_and_prefix_breaks():
    merged = Sample.from_record(record())
    samples = [merged, replace(merged, transition_id="b", merged_calls=3, split_at_break=False),
               Sample.from_record(record(transition_id="c", loss_mask=[], merged_calls=1, split_at_break=False))]
    result = StepResult(TokenStats(tokens=21), 0.1, 1.0, 3, 48, 0.5)
    report = StepReport.of("m", 1, Batch(samples, 0, Counts()), result)
    row = dict(zip(TRAIN_STEP_COLUMNS, report.row(), strict=True))
    assert row["calls_per_sample"] == pytest.approx(2.0) and row["prefix_breaks"] == 1
    assert "calls/sample 2.00 breaks 1" in report.line()
    plain = StepReport.of("m", 2, Batch([samples[2]], 0, Counts()), result)
    assert (plain.calls_per_sample, plain.prefix_breaks) == (1.0, 0) and "calls/sample" not in plain.line()

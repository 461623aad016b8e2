"""The train step: packed prompts, ratio one on its own generations, gradient accumulation, KL to the reference;
trajectory-level samples and demonstrations trained as their calls would be."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from agentstream.infra.config import TrainerConfig
from agentstream.models import teacher_forced_logprobs
from agentstream.trainer.batching import (
    Batch,
    Batcher,
    Counts,
    PackedMicroBatch,
    Sample,
    SeenIds,
    collate,
)
from agentstream.trainer.policy import build_policy
from agentstream.trainer.step import StepResult, token_logprobs, train_step
from tests.support.samples import CALL_1, CALL_2, MASK, PROMPT, TOOL, generated, record


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize(("row_tokens", "attention"), [(512, "eager"), (12, "eager"), (512, "sdpa")])
def test_a_packed_prompt_gives_the_same_logprobs_and_gradients_as_running_it_per_response(lora, row_tokens, attention):
    policy = build_policy(TrainerConfig(model="tiny", threads=1, device="cpu", lora=lora, lora_r=4,
                                        attention=attention))
    generator = torch.Generator().manual_seed(3)
    samples = []
    for group in range(3):
        prompt = torch.randint(5, 200, (4 + 2 * group,), generator=generator).tolist()
        for index in range(4):
            response = torch.randint(5, 200, (1 + (3 * index + group) % 6,), generator=generator).tolist()
            samples.append(Sample(f"s{group}{index}", "r", 0, prompt, response, [-1.0] * len(response), 1.0,
                                  float(index) - 1.5))
    shared, = collate(samples, policy.pad_id, "cpu", row_tokens=row_tokens)
    plain = [collate([s], policy.pad_id, "cpu")[0] for s in shared_order(samples)]
    assert isinstance(shared, PackedMicroBatch) and not any(isinstance(m, PackedMicroBatch) for m in plain)
    assert (shared.input_ids.shape[0] == 3) == (row_tokens == 512)  # one row per group, or several

    def weighted_logprobs(micro) -> tuple[torch.Tensor, list[torch.Tensor]]:
        policy.model.zero_grad(set_to_none=True)
        logprobs = token_logprobs(policy.model, micro, 1.0)[0]
        weights = micro.advantages[:, None].expand_as(logprobs)
        (logprobs * weights * micro.response_mask).sum().backward()
        return logprobs[micro.response_mask].detach(), [p.grad.clone() for p in policy.trainable()]

    shared_logprobs, shared_grads = weighted_logprobs(shared)
    rows = [weighted_logprobs(micro) for micro in plain]
    plain_logprobs = torch.cat([logprobs for logprobs, _ in rows])
    plain_grads = [sum(grads) for grads in zip(*(grads for _, grads in rows), strict=True)]
    assert shared_logprobs.shape == (sum(len(s.response_ids) for s in samples),)
    assert torch.allclose(shared_logprobs, plain_logprobs, atol=1e-5)
    # equal up to float32 rounding, which a different summation order changes (gradients reach 20 here)
    assert all(float((a - b).norm()) <= 1e-5 * float(b.norm()) + 1e-6
               for a, b in zip(shared_grads, plain_grads, strict=True))
    assert max(float(g.abs().max()) for g in shared_grads) > 0


def shared_order(samples: list[Sample]) -> list[Sample]:
    """The order ``collate`` puts samples in when their prompts repeat."""
    return sorted(samples, key=lambda s: (len(s.prompt_ids), s.prompt_ids, len(s.response_ids)))


def test_a_step_on_its_own_generations_has_ratio_one_and_raises_rewarded_logprobs(tiny_config):
    policy = build_policy(tiny_config)
    samples = generated(policy, 4, advantage=1.0)
    result = train_step(policy, Batch(samples, 0, Counts()), tiny_config)
    assert result.stats.mean("importance_weight") == pytest.approx(1.0, abs=1e-4)
    assert result.stats.clipped == 0 and result.transitions == 4 and result.tokens == 4 * 7
    micro, = collate(samples, policy.pad_id, "cpu")
    with torch.no_grad():
        after = token_logprobs(policy.model, micro, 1.0)[0][micro.response_mask]
    assert after.sum() > micro.behaviour_logprobs[micro.response_mask].sum()


def test_gradient_accumulation_matches_one_big_batch(tiny_config):
    deltas = []
    for micro_batches in (1, 3):
        policy = build_policy(replace(tiny_config, accumulation_steps=micro_batches))
        policy.optimizer = torch.optim.SGD(policy.trainable(), lr=1.0)
        before = [p.detach().clone() for p in policy.trainable()]
        samples = generated(policy, 5, advantage=0.0)
        samples = [replace(s, advantage=a) for s, a in zip(samples, (1.0, -0.5, 2.0, -1.0, 0.3), strict=True)]
        train_step(policy, Batch(samples, 0, Counts()), replace(tiny_config, accumulation_steps=micro_batches))
        deltas.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(policy.trainable(), before, strict=True)]))
    assert torch.allclose(deltas[0], deltas[1], atol=1e-6)
    assert deltas[0].abs().max() > 0


@pytest.mark.parametrize("lora", [False, True])
def test_kl_to_the_reference_starts_at_zero_and_grows_as_the_policy_moves(tiny_config, lora):
    config = replace(tiny_config, kl_coef=0.1, entropy_coef=0.01, lr=1e-2, lora=lora, lora_r=4)
    policy = build_policy(config)
    assert (policy.reference is None) == lora  # LoRA's reference is its own base, adapter off
    batch = Batch(generated(policy, 3, advantage=1.0), 0, Counts())
    first = train_step(policy, batch, config)
    second = train_step(policy, batch, config)
    assert first.stats.mean("kl") == pytest.approx(0.0, abs=1e-6)
    assert second.stats.mean("kl") > 1e-6
    assert second.stats.mean("entropy") > 0


# ---------------------------------------------------------------- trajectory-level samples


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


def test_a_supervised_step_is_the_mean_nll_of_trained_tokens_and_a_rejected_rollout_never_moves_weights(tiny_config):
    policy = build_policy(tiny_config)
    good = Sample.from_record(record(transition_id="good", advantage=-0.3))  # below its group's mean, still a success
    bad = Sample.from_record(record(transition_id="bad", reward=0.0, return_value=0.0, response_token_ids=[
        t + 20 for t in CALL_1 + TOOL + CALL_2]))
    logprobs = teacher_forced_logprobs(policy.model, PROMPT, CALL_1 + TOOL + CALL_2, 1.0)
    nll = -sum(lp for lp, kept in zip(logprobs, MASK, strict=True) if kept) / sum(MASK)  # tool tokens not counted

    def supervised_batch(*offered: Sample) -> Batch:
        b = Batcher(batch_tokens=0, batch_transitions=8, batch_wait_s=0, max_policy_lag=0, skip_zero_advantage=True,
                    seen=SeenIds(10), min_reward=1.0)
        for s in offered:
            b.offer(s, current_version=5, now=0)
        return b.take(current_version=5)

    both, result = step_delta(tiny_config, supervised_batch(good, bad).samples)
    assert result.loss == pytest.approx(nll, rel=1e-5) and result.stats.tokens == sum(MASK)
    assert torch.equal(both, step_delta(tiny_config, supervised_batch(good).samples)[0]) and both.abs().max() > 0
    assert supervised_batch(bad) is None  # alone it makes no step at all

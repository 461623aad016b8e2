"""The train step: packed prompts, ratio one on its own generations, gradient accumulation, KL to the reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from infra.config import TrainerConfig
from tests.support.samples import generated
from trainer.batching import (
    Batch,
    Counts,
    PackedMicroBatch,
    Sample,
    collate,
)
from trainer.policy import build_policy
from trainer.step import token_logprobs, train_step


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

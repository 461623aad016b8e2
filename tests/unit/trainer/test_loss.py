"""The dual-clip policy loss against hand-computed numbers: branches, masks, KL and entropy terms; masked tokens
of a trajectory-level sample."""

from __future__ import annotations

import math

import pytest
import torch

from agentstream.trainer.batching import Sample, collate
from agentstream.trainer.loss import policy_loss
from tests.support.samples import record


def test_each_branch_of_the_dual_clip_surrogate_by_hand():
    # ratio ρ and advantage A per token; ε = 0.2, c = 2:
    #   ρ=1.5 A=+1 -> min(1.5, 1.2)        = 1.2  loss -1.2  clipped, no gradient
    #   ρ=0.5 A=+1 -> min(0.5, 0.8)        = 0.5  loss -0.5  d/dlogp = -ρA = -0.5
    #   ρ=0.5 A=-1 -> min(-0.5, -0.8)      = -0.8 loss 0.8   clipped, no gradient
    #   ρ=3.0 A=-1 -> max(min(-3,-1.2),-2) = -2   loss 2.0   truncated at c, no gradient
    #   ρ=1.5 A=-1 -> max(min(-1.5,-1.2),-2) = -1.5 loss 1.5 d/dlogp = -ρA = +1.5
    ratios = torch.tensor([[1.5, 0.5, 0.5, 3.0, 1.5]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    behaviour = torch.full((1, 5), -1.0)
    logprobs = (behaviour + ratios.log()).requires_grad_()
    out = policy_loss(logprobs, behaviour, advantages, torch.ones(1, 5), clip_eps=0.2, importance_cap=2.0)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 2.0 + 1.5) / 5)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 5, 0.0, 0.0, 1.5 / 5])
    assert out.stats.tokens == 5
    assert out.stats.clipped == 2 and out.stats.truncated == 1
    assert out.stats.mean("importance_weight") == pytest.approx((1.5 + 0.5 + 0.5 + 2.0 + 1.5) / 5)
    assert out.stats.mean("pg_loss") == pytest.approx(2.6 / 5)


def test_mask_per_sequence_advantages_and_the_normalizer():
    behaviour = torch.log(torch.full((2, 3), 0.5))
    advantages = torch.tensor([2.0, -1.0])  # broadcast over each sequence's tokens
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # ratio 1 everywhere: tokens lose -2, -2 and +1; the masked ones count for nothing
    out = policy_loss(behaviour.clone(), behaviour, advantages, mask)
    assert out.loss.item() == pytest.approx(-3 / 3)
    halved = policy_loss(behaviour.clone(), behaviour, advantages, mask, weights=mask / 6)  # 1/6 per token, not 1/3
    assert halved.loss.item() == pytest.approx(-0.5)


def test_kl_and_entropy_terms_by_hand():
    logprobs = torch.log(torch.tensor([[0.25]]))
    reference = torch.log(torch.tensor([[0.5]]))
    # k3: exp(r - l) - (r - l) - 1 with r - l = ln 2  ->  2 - ln 2 - 1
    kl = 1 - math.log(2)
    out = policy_loss(logprobs, logprobs.clone(), torch.tensor([0.0]), torch.ones(1, 1), ref_logprobs=reference,
                      kl_coef=0.1, entropy=torch.tensor([[1.5]]), entropy_coef=0.01)
    assert out.loss.item() == pytest.approx(0.1 * kl - 0.01 * 1.5)
    assert out.stats.mean("kl") == pytest.approx(kl)
    assert out.stats.mean("entropy") == pytest.approx(1.5)


# ---------------------------------------------------------------- trajectory-level samples


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

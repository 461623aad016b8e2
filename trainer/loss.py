"""The token-level policy loss: dual-clip PPO against the behaviour policy, with optional KL and entropy terms.

For every trained token t of a sample with advantage A (broadcast over its tokens, so a merged
trajectory sample's advantage, its rollout's, applies to every token the model generated in it):

    ρ_t  = exp(logp_t − behaviour_logp_t)                 ratio to the policy that generated the token
    s_t  = min(ρ_t·A, clip(ρ_t, 1 − ε, 1 + ε)·A)          PPO's clipped surrogate
    s_t  = max(s_t, c·A)            where A < 0           truncated importance weight: ρ counts at most c
    s_t  = A·logp_t                 for a demonstration   likelihood: no behaviour policy, no ratio
    kl_t = exp(r_t − logp_t) − (r_t − logp_t) − 1         k3 estimate of KL(π ‖ π_ref), r_t from the reference
    loss = Σ_t w_t·(−s_t + β·kl_t − α·H_t)

**Trained tokens.** A sample's loss mask says which response tokens the model generated; the
others (tool results and template glue between the calls of a trajectory-level sample) are
inputs only: w_t = 0, and they count in no statistic (tokens, KL, entropy, clip fraction...).
Their behaviour logprobs are never read.

**Normalisation** (``trainer.loss_normalization``), as token weights w_t that sum to 1 over the
step's trained tokens, computed over the whole step before it is cut into micro-batches, so
gradient accumulation gives the same gradient as one big batch:
- ``token``: w_t = 1/N, N the step's trained tokens (a long sample weighs more);
- ``transition``: w_t = 1/(n_i·S), the mean over each sample's n_i tokens, then over S samples;
- ``rollout``: w_t = 1/(n_r·R), the mean over all trained tokens of a rollout in the step, then
  over its R rollouts (a rollout of many calls or long tool loops counts as much as a short one).

**Demonstrations.** A sample with token ids but no behaviour logprobs (a scripted correct
trajectory sent through the pipeline as a warm start) has no behaviour policy to take a ratio
against; its trained tokens train by likelihood, −A·logp_t, weighted like every other token.
Such a record used to be refused for its logprob count; it is taken on purpose now, and only
with A > 0 (unlikelihood, pushing logp_t down without bound, is refused as invalid).

With A > 0 the PPO clip already bounds the weight by 1 + ε; with A < 0 the truncation at c
(dual-clip PPO) keeps a token that became much likelier since it was sampled, the typical
stale sample, from getting an unbounded weight. The ratio is taken against the behaviour
logprobs recorded at generation, so off-policy (stale) data is corrected without a separate
old-policy pass.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class TokenStats:
    """Sums over the trained tokens of one or more micro-batches; divide by ``tokens`` for means."""

    tokens: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clipped: float = 0.0
    truncated: float = 0.0
    importance_weight: float = 0.0

    def __add__(self, other: TokenStats) -> TokenStats:
        return TokenStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def mean(self, name: str) -> float:
        """The per-token mean of one summed field."""
        return getattr(self, name) / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class LossOutput:
    """The differentiable loss of a micro-batch and its token statistics."""

    loss: torch.Tensor
    stats: TokenStats


def policy_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_eps: float = 0.2, importance_cap: float = 2.0,
                ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
                entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                weights: torch.Tensor | None = None, likelihood: torch.Tensor | None = None) -> LossOutput:
    """The loss in the module docstring; tensors are [batch, tokens] (advantages, likelihood may be [batch]).

    ``mask`` marks the trained tokens; ``weights`` their w_t (default: 1/count of ``mask``, the
    token mean of this call alone); ``likelihood`` marks demonstrations, trained by likelihood.
    """
    mask = mask.bool()
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.expand_as(logprobs)
    tokens = float(mask.sum())
    if weights is None:
        weights = mask / max(tokens, 1.0)
    demonstrated = torch.zeros_like(mask) if likelihood is None else (
        likelihood[:, None] if likelihood.dim() == 1 else likelihood).expand_as(mask)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    negative = advantages < 0
    surrogate = torch.where(negative, torch.maximum(surrogate, importance_cap * advantages), surrogate)
    surrogate = torch.where(demonstrated, advantages * logprobs, surrogate)
    per_token = -surrogate
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        log_ratio = ref_logprobs - logprobs
        kl = torch.exp(log_ratio) - log_ratio - 1
        per_token = per_token + kl_coef * kl
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    loss = torch.where(mask, per_token * weights, 0.0).sum()
    with torch.no_grad():
        sampled = mask & ~demonstrated  # a demonstration's tokens have no importance ratio to clip or truncate
        clipped = ((advantages > 0) & (ratio > 1 + clip_eps)) | (negative & (ratio < 1 - clip_eps))
        truncated = negative & (ratio > importance_cap)
        importance = torch.where(demonstrated, 1.0, ratio.clamp(max=importance_cap))
        stats = TokenStats(
            tokens=tokens,
            pg_loss=float((-surrogate * mask).sum()),
            kl=float((kl * mask).sum()),
            entropy=float((entropy * mask).sum()) if entropy is not None else 0.0,
            clipped=float((clipped & sampled).sum()),
            truncated=float((truncated & sampled).sum()),
            importance_weight=float((importance * mask).sum()),
        )
    return LossOutput(loss, stats)

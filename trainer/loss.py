"""The token-level policy loss: dual-clip PPO against the behaviour policy, with optional KL and entropy terms.

For every response token t of a transition with advantage A (broadcast over its tokens):

    ρ_t  = exp(logp_t − behaviour_logp_t)                 ratio to the policy that generated the token
    s_t  = min(ρ_t·A, clip(ρ_t, 1 − ε, 1 + ε)·A)          PPO's clipped surrogate
    s_t  = max(s_t, c·A)            where A < 0           truncated importance weight: ρ counts at most c
    kl_t = exp(r_t − logp_t) − (r_t − logp_t) − 1         k3 estimate of KL(π ‖ π_ref), r_t from the reference
    loss = Σ_t mask_t·(−s_t + β·kl_t − α·H_t) / N

N is the number of response tokens in the whole optimizer step (``normalizer``), so gradient
accumulation over micro-batches gives the same gradient as one big batch. With A > 0 the PPO
clip already bounds the weight by 1 + ε; with A < 0 the truncation at c (dual-clip PPO) keeps
a token that became much likelier since it was sampled, the typical stale sample, from
getting an unbounded weight. The ratio is taken against the behaviour logprobs recorded at
generation, so off-policy (stale) data is corrected without a separate old-policy pass.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class TokenStats:
    """Sums over the response tokens of one or more micro-batches; divide by ``tokens`` for means."""

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
                normalizer: float | None = None) -> LossOutput:
    """The loss in the module docstring; tensors are [batch, tokens] (advantages may be [batch])."""
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.expand_as(logprobs)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    negative = advantages < 0
    surrogate = torch.where(negative, torch.maximum(surrogate, importance_cap * advantages), surrogate)
    per_token = -surrogate
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        log_ratio = ref_logprobs - logprobs
        kl = torch.exp(log_ratio) - log_ratio - 1
        per_token = per_token + kl_coef * kl
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    tokens = float(mask.sum())
    loss = (per_token * mask).sum() / (normalizer if normalizer else max(tokens, 1.0))
    with torch.no_grad():
        clipped = ((advantages > 0) & (ratio > 1 + clip_eps)) | (negative & (ratio < 1 - clip_eps))
        truncated = negative & (ratio > importance_cap)
        stats = TokenStats(
            tokens=tokens,
            pg_loss=float((-surrogate * mask).sum()),
            kl=float((kl * mask).sum()),
            entropy=float((entropy * mask).sum()) if entropy is not None else 0.0,
            clipped=float((clipped * mask).sum()),
            truncated=float((truncated * mask).sum()),
            importance_weight=float((ratio.clamp(max=importance_cap) * mask).sum()),
        )
    return LossOutput(loss, stats)

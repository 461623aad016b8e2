"""One training step: teacher-forced forward on prompt + response ids, policy loss, backward, clip, optimizer step.

A step whose loss or gradient norm is not finite is skipped: its gradients are dropped and the
optimizer does not step, so neither the weights nor AdamW's moments ever see a NaN or an infinity.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from agentstream.infra.config import TrainerConfig
from agentstream.trainer.batching import Batch, MicroBatch, PackedMicroBatch, collate
from agentstream.trainer.loss import TokenStats, policy_loss
from agentstream.trainer.policy import Policy


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did: token statistics, gradient norm, size and timing.

    ``skipped``: the loss or the gradient norm was not finite, so the optimizer did not step.
    """

    stats: TokenStats
    loss: float
    grad_norm: float
    transitions: int
    tokens: int
    seconds: float
    skipped: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def token_logprobs(model: torch.nn.Module, micro: MicroBatch | PackedMicroBatch, temperature: float,
                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token under softmax(logits / T), and the entropy of that distribution."""
    if isinstance(micro, PackedMicroBatch):
        logits = _packed_logits(model, micro).float()
    else:
        logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask,
                       logits_to_keep=micro.logits_to_keep).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, micro.targets[..., None]).squeeze(-1), entropy


def _packed_logits(model: Any, micro: PackedMicroBatch) -> torch.Tensor:
    """Logits for every response column of packed rows: the decoder under the block mask, the head at the predictors.

    The head runs only where a response token is predicted; a causal LM's logits are its output
    embeddings applied to its decoder's last hidden state (as in Llama-family models). Eager
    attention adds the mask to its scores, so it is given as 0 / -inf-like floats; sdpa takes it
    as booleans.
    """
    mask = micro.attends[:, None]
    if model.config._attn_implementation == "eager":
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    hidden = model.get_decoder()(input_ids=micro.input_ids, attention_mask=mask,
                                 position_ids=micro.position_ids).last_hidden_state
    return model.get_output_embeddings()(hidden[micro.row_of[:, None], micro.predictors])


def reference_logprobs(policy: Policy, micro: MicroBatch | PackedMicroBatch, temperature: float) -> torch.Tensor:
    """Target logprobs under the frozen reference: a separate model, or the LoRA base with the adapter off."""
    model = policy.reference or policy.model
    peft_model: Any = policy.model  # a PeftModel when there is no reference (torch types its attributes as Tensor)
    adapter_off = peft_model.disable_adapter() if policy.reference is None else nullcontext()
    with torch.no_grad(), adapter_off, policy.precision.autocast():
        return token_logprobs(model, micro, temperature)[0]


def train_step(policy: Policy, batch: Batch, config: TrainerConfig) -> StepResult:
    """Accumulate the loss over micro-batches (token weights over the whole step), then one optimizer step.

    Where the loss or the gradient norm is not finite, the gradients are zeroed and no step is
    taken (``skipped``): the weights and the optimizer state stay as they were.
    """
    started = time.perf_counter()
    policy.model.train()
    stats, loss = accumulate(policy, collate(batch.samples, policy.pad_id, policy.device, config.accumulation_steps,
                                             micro_batch_tokens=config.micro_batch_tokens,
                                             normalization=config.loss_normalization), config)
    grad_norm, skipped = apply_gradients(policy, config, loss)
    return StepResult(stats, loss, grad_norm, len(batch.samples), batch.tokens, time.perf_counter() - started,
                      skipped)


def accumulate(policy: Policy, micros: list[MicroBatch | PackedMicroBatch],
               config: TrainerConfig) -> tuple[TokenStats, float]:
    """Forward and backward over the micro-batches: their gradients add up in ``.grad``; the summed stats and loss."""
    stats, loss = TokenStats(), 0.0
    for micro in micros:
        with policy.precision.autocast():  # bf16 compute over fp32 master weights under mixed precision
            logprobs, entropy = token_logprobs(policy.model, micro, config.temperature, config.entropy_coef > 0)
        reference = reference_logprobs(policy, micro, config.temperature) if config.kl_coef > 0 else None
        out = policy_loss(logprobs, micro.behaviour_logprobs, micro.advantages, micro.response_mask,
                          clip_eps=config.clip_eps, importance_cap=config.importance_cap, ref_logprobs=reference,
                          kl_coef=config.kl_coef, entropy=entropy, entropy_coef=config.entropy_coef,
                          weights=micro.weights, likelihood=micro.likelihood)
        out.loss.backward()
        stats, loss = stats + out.stats, loss + out.loss.item()
    return stats, loss


def apply_gradients(policy: Policy, config: TrainerConfig, loss: float) -> tuple[float, bool]:
    """Clip, then step unless the loss or the gradient norm is not finite; gradients are cleared either way."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.trainable(), config.grad_clip))
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if not skipped:
        policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped

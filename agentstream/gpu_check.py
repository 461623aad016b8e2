"""Checks of a machine's device path: trainer and server agree on logprobs, and how fast each precision runs.

``make gpu-check`` runs the device tests on CUDA and ``bench/precision.py``, which prints these
figures; the tests use the same functions, so the bench measures what the tests assert.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from agentstream.infra.config import TrainerConfig
from agentstream.models import load_model
from agentstream.models.precision import resolve_precision
from agentstream.serving.generation import BatchRequest, SamplingParams, generate_batch
from agentstream.serving.lora import LoraAdapter, LoraLayer, MergedWeights, applied
from agentstream.trainer.batching import Batch, Counts, Sample, collate
from agentstream.trainer.policy import Policy, build_policy
from agentstream.trainer.step import token_logprobs, train_step


def _policy(model: str, device: str, dtype: str) -> Policy:
    return build_policy(TrainerConfig(model=model, device=device, dtype=dtype))


def _generate(policy: Policy, prompts: list[list[int]], max_tokens: int, seed: int = 0) -> list[Sample]:
    """Sampled continuations as trainer samples whose behaviour logprobs are the server's, as the proxy records them."""
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=True)
    policy.model.eval()
    results = generate_batch(policy.model, policy.tokenizer, [BatchRequest(p, params) for p in prompts],
                             eos_ids=set(), pad_id=policy.pad_id, autocast=policy.precision.autocast)
    return [Sample(f"s{index}", "r", 0, prompt, states[0].token_ids, [e.logprob for e in states[0].logprobs], 1.0, 1.0)
            for index, (prompt, states) in enumerate(zip(prompts, results, strict=True))]


def _prompts(count: int, vocab: int, length: int = 12) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(5, min(vocab, 250), (length,), generator=generator).tolist() for _ in range(count)]


def initial_ratio_max_abs_dev(model: str, device: str, dtype: str, *, prompts: int = 8, max_tokens: int = 32) -> float:
    """max |log ratio| on a first step: the server's sampled logprobs vs the trainer's recomputation, same weights."""
    policy = _policy(model, device, dtype)
    samples = _generate(policy, _prompts(prompts, len(policy.tokenizer)), max_tokens)
    (micro,) = collate(samples, policy.pad_id, policy.device)
    with torch.no_grad(), policy.precision.autocast():
        recomputed = token_logprobs(policy.model, micro, 1.0)[0]
    mask = micro.response_mask.bool()
    return float((recomputed[mask] - micro.behaviour_logprobs[mask]).abs().max())


def generation_tokens_per_s(model: str, device: str, dtype: str, *, batch: int = 16, max_tokens: int = 64,
                            lora_rank: int = 0) -> float:
    """Sampled tokens per second for a batch of prompts (after one warm-up batch), on a model server's copy.

    The copy is loaded as ``serve-model`` loads it (``inference_only``: Linear weights cast once
    under mixed precision). With ``lora_rank`` > 0 the batch runs on a random LoRA adapter of that
    rank on every linear layer but the head, as a served checkpoint of the online demo does.
    """
    served = load_model(model, precision=resolve_precision(device, dtype), inference_only=True)
    prompts = _prompts(batch, len(served.tokenizer))
    adapter = _random_adapter(served.model, lora_rank) if lora_rank else None
    merged = MergedWeights()  # as the server keeps them: merged once, by the warm-up

    def sample(requests: list[list[int]], tokens: int) -> int:
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, logprobs=True)
        with applied(adapter, served.model, merged):
            results = generate_batch(served.model, served.tokenizer, [BatchRequest(p, params) for p in requests],
                                     eos_ids=set(), autocast=served.autocast)
        return sum(len(states[0].token_ids) for states in results)

    sample(prompts, max_tokens)  # warm-up at the measured shapes: a 2-prompt, 4-token one left bf16 on CUDA 7x slow
    started = time.perf_counter()
    sampled = sample(prompts, max_tokens)
    _synchronize(served.model)
    return sampled / (time.perf_counter() - started)


def _random_adapter(model: torch.nn.Module, rank: int) -> LoraAdapter:
    hf: Any = model  # a transformers model (torch types its attributes as Tensor | Module)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    generator = torch.Generator().manual_seed(3)
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            a = torch.randn(rank, module.in_features, generator=generator) * module.in_features ** -0.5
            b = torch.randn(module.out_features, rank, generator=generator) * 1e-3
            weight = module.weight
            layers[name] = LoraLayer(a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype), 2.0)
    return LoraAdapter("random", "", 1, layers)


def trainer_tokens_per_s(model: str, device: str, dtype: str, *, batch: int = 16, length: int = 256,
                         steps: int = 3) -> float:
    """Trained tokens per second of full optimizer steps on ``batch`` sequences of ``length`` tokens."""
    config = TrainerConfig(model=model, device=device, dtype=dtype)
    policy = build_policy(config)
    vocab = min(len(policy.tokenizer), 250)
    generator = torch.Generator().manual_seed(5)
    samples = []
    for index in range(batch):
        ids = torch.randint(5, vocab, (length,), generator=generator).tolist()
        half = length // 2
        samples.append(Sample(f"t{index}", "r", 0, ids[:half], ids[half:], [-5.0] * (length - half), 1.0,
                              1.0 if index % 2 else -1.0))
    train_step(policy, Batch(samples, 0, Counts()), config)  # warm-up
    _synchronize(policy.model)
    started = time.perf_counter()
    for _ in range(steps):
        train_step(policy, Batch(samples, 0, Counts()), config)
    _synchronize(policy.model)
    return steps * batch * length / (time.perf_counter() - started)


def _synchronize(model: torch.nn.Module) -> None:
    """Wait for the model's device to finish queued work (CUDA runs kernels asynchronously)."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""Teacher-forced logprobs: what a model assigns to tokens it is shown, the reference for sampled logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def teacher_forced_logprobs(model: torch.nn.Module, prompt_ids: Sequence[int], response_ids: Sequence[int],
                            temperature: float,
                            autocast: AbstractContextManager | None = None) -> list[float]:
    """Log-probability of each response token under softmax(logits / temperature) given everything before it.

    Temperature 0 means greedy decoding, whose logprobs are reported at temperature 1. The
    forward pass runs on the model's device, inside ``autocast`` (the model's precision) if given.
    """
    import torch

    if not prompt_ids:
        raise ValueError("teacher_forced_logprobs needs at least one prompt token")
    if not response_ids:
        return []
    device = next((parameter.device for parameter in model.parameters()), torch.device("cpu"))
    ids = torch.tensor([[*prompt_ids, *response_ids]], dtype=torch.long, device=device)
    with torch.inference_mode(), autocast or nullcontext():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    scale = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits / scale, dim=-1)
    targets = torch.tensor(list(response_ids), dtype=torch.long, device=device)
    return logprobs.gather(-1, targets[:, None]).squeeze(-1).tolist()

"""Teacher-forced logprobs: what a model assigns to tokens it is shown, the reference for sampled logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def teacher_forced_logprobs(model: torch.nn.Module, prompt_ids: Sequence[int], response_ids: Sequence[int],
                            temperature: float) -> list[float]:
    """Log-probability of each response token under softmax(logits / temperature) given everything before it.

    Temperature 0 means greedy decoding, whose logprobs are reported at temperature 1.
    """
    if not prompt_ids:
        raise ValueError("teacher_forced_logprobs needs at least one prompt token")
    if not response_ids:
        return []
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    scale = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits / scale, dim=-1)
    targets = torch.tensor(list(response_ids), dtype=torch.long)
    return logprobs.gather(-1, targets[:, None]).squeeze(-1).tolist()

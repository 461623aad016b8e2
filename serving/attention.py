"""Grouped-query attention that reads the KV cache as it is, for models with fewer key/value heads than query heads.

transformers' sdpa attention repeats every layer's keys and values once per query head of a
group whenever it passes a mask, which it always does for a left-padded batch: SmolLM2 (9 query
heads over 3 key/value heads) copied its whole cache three times per layer at every decoded
token, 12% of a profiled one-thread CPU wave. Here a key/value head's queries are stacked along
the query axis instead (the mask repeated to match), so one sdpa call per layer attends to the
cache in place. Same mask, same kernel, same numbers up to float summation order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

GROUPED_SDPA = "agentstream_grouped_sdpa"


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An attention function for transformers: (batch, heads, queries, width) in, (batch, queries, heads, width) out."""
    batch, heads, queries, width = query.shape
    group = heads // key.shape[1]
    stacked = query.reshape(batch, key.shape[1], group * queries, width)  # heads are (kv head, member) in order
    mask = attention_mask
    if mask is None and queries > 1:
        keys = key.shape[2]
        mask = torch.ones((queries, keys), dtype=torch.bool, device=query.device).tril(keys - queries)[None, None]
    if mask is not None:
        mask = mask[:, :, :, : key.shape[2]].repeat(1, 1, group, 1)
    output = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return output.reshape(batch, heads, queries, width).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_attention(model: torch.nn.Module) -> bool:
    """Switch a transformers model on sdpa with grouped key/value heads to ``grouped_sdpa``; whether it did."""
    if not isinstance(model, PreTrainedModel):
        return False
    config: Any = model.config
    heads, kv_heads = getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", 0)
    if config._attn_implementation != "sdpa" or not kv_heads or heads == kv_heads or heads % kv_heads:
        return False
    model.set_attn_implementation(GROUPED_SDPA)
    return True

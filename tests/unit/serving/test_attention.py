"""Grouped-query attention on the cache in place: the same logits and the same exact logprobs as transformers' sdpa."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentstream.models import LoadedModel, load_model, tiny_tokenizer
from agentstream.serving.attention import GROUPED_SDPA, use_grouped_attention
from agentstream.serving.generation import BatchRequest, SamplingParams, generate_batch
from tests.support.servers import assert_exact


def grouped_tiny() -> LoadedModel:
    """A random tiny Llama with 4 query heads over 2 key/value heads, on sdpa."""
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         attn_implementation="sdpa")
    torch.manual_seed(11)
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name="grouped-tiny", dtype=torch.float32, source="test")


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_grouped_attention_gives_sdpa_logits_on_a_left_padded_batch_and_without_a_mask():
    sdpa = grouped_tiny().model
    grouped = copy.deepcopy(sdpa)
    assert use_grouped_attention(grouped) and grouped.config._attn_implementation == GROUPED_SDPA
    ids, mask, positions = left_padded([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]])
    with torch.inference_mode():
        expected = sdpa(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = grouped(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        unmasked = grouped(input_ids=ids[:1]).logits, sdpa(input_ids=ids[:1]).logits
    assert torch.allclose(got[mask.bool()], expected[mask.bool()], atol=1e-5)
    assert torch.allclose(*unmasked, atol=1e-5)


def test_decoding_on_grouped_attention_keeps_every_row_exact():
    """Prompts of different lengths (left padding), a shared prompt, rows ending early: sdpa recomputes the logprobs."""
    loaded = grouped_tiny()
    reference = copy.deepcopy(loaded.model)
    assert use_grouped_attention(loaded.model)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [5, 6, 7, 8, 9, 10]]
    requests = [BatchRequest(prompt, SamplingParams(max_tokens=length, temperature=1.0, seed=number, n=2,
                                                    ignore_eos=True, logprobs=True))
                for number, (prompt, length) in enumerate(zip(prompts, [4, 30, 17], strict=True))]
    results = generate_batch(loaded.model, loaded.tokenizer, requests, eos_ids=set())
    for request, states in zip(requests, results, strict=True):
        for state in states:
            assert len(state.token_ids) == request.params.max_tokens
            assert_exact(loaded, reference, list(request.prompt_ids), state.token_ids, None,
                         [entry.logprob for entry in state.logprobs], 1.0)


def test_models_without_grouped_heads_or_on_another_kernel_keep_their_attention():
    tiny = load_model("tiny").model  # 4 query heads over 4 key/value heads
    before = tiny.config._attn_implementation
    assert not use_grouped_attention(tiny) and tiny.config._attn_implementation == before
    eager = grouped_tiny().model
    eager.set_attn_implementation("eager")
    assert not use_grouped_attention(eager) and eager.config._attn_implementation == "eager"

"""The decoding cache: rows leave the batch and buffers grow past the reserved room, every row still exact."""

from __future__ import annotations

from transformers.cache_utils import Cache

from agentstream.serving.generation import BatchRequest, SamplingParams, generate_batch
from agentstream.serving.kv_cache import ROOM, decoding_cache
from tests.support.servers import assert_exact


def test_decoding_in_place_past_the_reserved_room_keeps_every_row_exact(tiny):
    """Rows that end at different steps leave the batch, and decoding past ``ROOM`` grows the buffers: still exact."""
    assert isinstance(decoding_cache(tiny.model), Cache)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    lengths = [3, 40, ROOM + 20]
    requests = [BatchRequest(prompts[number % 2], SamplingParams(max_tokens=length, temperature=1.0, seed=number,
                                                                 ignore_eos=True, logprobs=True))
                for number, length in enumerate(lengths)]
    results = generate_batch(tiny.model, tiny.tokenizer, requests, eos_ids=set())
    for request, (state,), length in zip(requests, results, lengths, strict=True):
        assert len(state.token_ids) == length
        assert_exact(tiny, tiny.model, list(request.prompt_ids), state.token_ids, None,
                     [entry.logprob for entry in state.logprobs], 1.0)

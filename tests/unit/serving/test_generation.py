"""Batched generation: one prefill per shared prompt, text deltas, stop conditions, top-k/top-p and sampling."""

from __future__ import annotations

import pytest
import torch

from agentstream.models import tiny_tokenizer
from agentstream.serving.generation import BatchRequest, SamplingParams, SequenceState, draw, generate_batch, truncate
from tests.support.servers import TOLERANCE


def test_requests_with_the_same_prompt_share_one_prefill_and_each_gets_what_it_would_alone(tiny):
    """A GRPO group's rollouts send one request each with the same prompt: it is prefilled once, not per request."""
    group, other = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    requests = [BatchRequest(group, SamplingParams(max_tokens=8, temperature=1.0, seed=seed, logprobs=True))
                for seed in (1, 2, 3)]
    requests.append(BatchRequest(other, SamplingParams(max_tokens=8, temperature=1.0, seed=4, logprobs=True)))
    prefill_rows: list[int] = []
    hook = tiny.model.register_forward_pre_hook(
        lambda module, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        together = generate_batch(tiny.model, tiny.tokenizer, requests, eos_ids=set())
    finally:
        hook.remove()
    assert prefill_rows[0] == 2 and set(prefill_rows[1:]) == {4}  # two distinct prompts, then four rows decoding
    for request, (batched,) in zip(requests, together, strict=True):
        (alone,) = generate_batch(tiny.model, tiny.tokenizer, [request], eos_ids=set())[0]
        assert batched.token_ids == alone.token_ids
        assert [e.logprob for e in batched.logprobs] == pytest.approx([e.logprob for e in alone.logprobs],
                                                                      abs=TOLERANCE)
    assert len({tuple(states[0].token_ids) for states in together[:3]}) == 3  # same prompt, own seeds, own samples


def test_text_deltas_hold_back_partial_characters_and_stop_strings():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("a€b", add_special_tokens=False)  # € is three bytes
    sequence = SequenceState(0, tokenizer, SamplingParams(max_tokens=10), {tokenizer.eos_token_id})
    assert [sequence.append(i, None).text for i in ids] == ["a", "", "", "€", "b"]

    stopped = SequenceState(0, tokenizer, SamplingParams(max_tokens=10, stop=("END",)), {tokenizer.eos_token_id})
    deltas = [stopped.append(i, None) for i in tokenizer.encode("okEND!", add_special_tokens=False)[:5]]
    assert "".join(d.text for d in deltas) == "ok" == stopped.text
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "END")
    assert stopped.token_ids == tokenizer.encode("okEND", add_special_tokens=False)


def test_eos_and_stop_token_ids_end_sequences_and_stay_in_token_ids():
    tokenizer = tiny_tokenizer()
    eos = tokenizer.eos_token_id
    sequence = SequenceState(0, tokenizer, SamplingParams(max_tokens=10), {eos})
    last = [sequence.append(i, None) for i in [*tokenizer.encode("hi", add_special_tokens=False), eos]][-1]
    assert (last.finish_reason, last.stop_reason, sequence.text, sequence.token_ids[-1]) == ("stop", None, "hi", eos)
    by_id = SequenceState(0, tokenizer, SamplingParams(max_tokens=10, stop_token_ids=(ord("x") + 3,)), {eos})
    assert by_id.append(ord("x") + 3, None).stop_reason == ord("x") + 3


def test_top_k_and_top_p_truncation():
    logprobs = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]), dim=-1)
    kept = lambda masked: torch.isfinite(masked)[0].tolist()  # noqa: E731
    assert kept(truncate(logprobs, 2, 1.0)) == [True, True, False, False, False]
    probs = logprobs.exp()[0]
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert kept(truncate(logprobs, 0, 0.7)) == [True, True, False, False, False]
    assert kept(truncate(logprobs, 0, 1.0)) == [True] * 5


def test_draw_follows_the_probabilities_and_never_picks_an_impossible_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(20_000, 1)
    picked = draw(probs, torch.Generator().manual_seed(3))
    counts = torch.bincount(picked, minlength=6) / len(picked)
    assert counts[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(counts[[1, 3, 4]], torch.tensor([0.5, 0.3, 0.2]), atol=0.015)
    assert torch.equal(draw(probs[:50], torch.Generator().manual_seed(3)), picked[:50])  # a seed replays
    unnormalised = torch.tensor([[0.0, 0.0, 0.0, 7.0]])  # truncation leaves rows that need not sum to 1
    assert draw(unnormalised, torch.Generator().manual_seed(0)).tolist() == [3]

"""The dev server's decode loop: KV-cached sampling of many requests in one batch, with exact logprobs.

Logprob convention: each sampled token's logprob is taken under softmax(logits / temperature),
temperature applied and BEFORE top-k/top-p truncation. That is what a trainer recomputes with a
teacher-forced forward at the same temperature (``models.teacher_forced_logprobs``), and what
vLLM reports with ``--logprobs-mode processed_logprobs`` when top-k/top-p are off (vLLM's
default ``raw_logprobs`` ignores temperature). Temperature 0 is greedy decoding; its logprobs
are reported at temperature 1. ``top_logprobs`` come from the same distribution.

Token ids are reported exactly as sampled, including a final EOS or stop token id (as vLLM
does); text is ``tokenizer.decode(ids, skip_special_tokens=True)``, cut before a matched stop
string. Text deltas are emitted incrementally: the difference of decoding all ids so far,
holding back while that decode ends in U+FFFD (a partial multi-byte character) and holding
back the last ``len(longest stop string) - 1`` characters until the sequence ends.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from agentstream.serving.kv_cache import decoding_cache

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: the subset of vLLM's sampling parameters the dev server honours."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k truncation
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one sampled token and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Delta:
    """What one sequence produced in one step: new ids, their logprobs, safe new text, and maybe its end."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class SequenceState:
    """One sequence being generated: ids so far, its text, and how much of the text was already emitted."""

    index: int
    tokenizer: Any
    params: SamplingParams
    eos_ids: Collection[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def append(self, token_id: int, logprob: TokenLogprob | None) -> Delta:
        """Add one sampled token, decide whether the sequence ended, and return what became safe to emit."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if token_id in self.params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        elif token_id in self.eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
        else:
            matched = find_stop_string(text, self.params.stop)
            if matched is not None:
                text = text[:matched[0]]
                self.finish_reason, self.stop_reason = "stop", matched[1]
            elif len(self.token_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        self.text = text
        safe = text if self.finished else self._safe_prefix(text)
        new_text = safe[self.emitted:] if len(safe) > self.emitted else ""
        self.emitted += len(new_text)
        return Delta(self.index, [token_id], [logprob] if logprob is not None else [], new_text,
                     self.finish_reason, self.stop_reason)

    @property
    def finished(self) -> bool:
        """Whether the sequence has ended."""
        return self.finish_reason is not None

    def _safe_prefix(self, text: str) -> str:
        """The part of an unfinished sequence's text that can no longer change or turn out to be a stop string."""
        safe = text.rstrip(REPLACEMENT_CHAR)
        if self.params.stop:
            holdback = max(len(stop) for stop in self.params.stop) - 1
            safe = safe[:max(0, len(safe) - holdback)]
        return safe


def find_stop_string(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any stop string in ``text`` as (position, stop string), or None."""
    found = [(position, stop) for stop in stops if stop and (position := text.find(stop)) >= 0]
    return min(found) if found else None


def scaled_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature), with temperature 0 (greedy) reported at temperature 1."""
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / scale, dim=-1)


def truncate(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k, then outside the top-p nucleus of what is left."""
    masked = logprobs
    if 0 < top_k < masked.shape[-1]:
        kth = torch.topk(masked, top_k, dim=-1).values[..., -1:]
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(masked, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        outside = (probs.cumsum(dim=-1) - probs) > top_p  # the mass before a token already reaches top_p
        masked = masked.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    return masked


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return the ids and the full logprob rows they were reported under."""
    logprobs = scaled_logprobs(logits, params.temperature)
    if params.temperature == 0:
        return logits.argmax(dim=-1), logprobs
    probs = torch.softmax(truncate(logprobs, params.top_k, params.top_p), dim=-1)
    return draw(probs, generator), logprobs


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row by inverse CDF: one uniform a row, where ``torch.multinomial`` draws one per vocabulary entry.

    On a CPU, multinomial's 49,152 exponentials a row took 15% of a profiled SmolLM2 wave.
    A zero-probability token is never drawn: the cumulative sum does not rise at it.
    """
    cumulative = probs.cumsum(dim=-1)
    uniform = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cumulative.dtype)
    picked = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True)
    return picked.squeeze(-1).clamp(max=probs.shape[-1] - 1)


def token_logprobs(ids: torch.Tensor, logprobs: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Per-row TokenLogprob of the sampled ids, with the ``top`` most likely alternatives."""
    chosen = logprobs.gather(-1, ids[:, None]).squeeze(-1).tolist()
    if top > 0:
        best = torch.topk(logprobs, top, dim=-1)
        alternatives = [tuple(zip(row_ids, row_lps, strict=True)) for row_ids, row_lps
                        in zip(best.indices.tolist(), best.values.tolist(), strict=True)]
    else:
        alternatives = [()] * len(chosen)
    return [TokenLogprob(token_id, logprob, alts)
            for token_id, logprob, alts in zip(ids.tolist(), chosen, alternatives, strict=True)]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private RNG on ``device``: seeded for reproducible sampling, else from system entropy."""
    seed = random.SystemRandom().getrandbits(63) if seed is None else seed % 2**63
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class BatchRequest:
    """One request's share of a batched generation: its prompt, sampling, and where its steps go."""

    prompt_ids: Sequence[int]
    params: SamplingParams
    emit: Callable[[list[Delta]], None] = lambda deltas: None
    cancelled: Callable[[], bool] = lambda: False


def _prefill(model: torch.nn.Module, prompts: list[Sequence[int]], pad_id: int, device: torch.device):
    """Left-pad the prompts into one batch and run it; returns (cache, last logits, attention mask, next positions)."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    output = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=decoding_cache(model),
                   use_cache=True, logits_to_keep=1)
    return output.past_key_values, output.logits[:, -1, :], mask, positions[:, -1] + 1


def generate_batch(model: torch.nn.Module, tokenizer: Any, requests: Sequence[BatchRequest],
                   eos_ids: Collection[int], pad_id: int = 0,
                   autocast: Callable[[], AbstractContextManager] = nullcontext) -> list[list[SequenceState]]:
    """Sample every request's ``params.n`` continuations in one decode loop (requests may differ in prompt and params).

    Prompts are left-padded and each distinct prompt is prefilled once, then its KV cache is
    repeated for every row that starts from it: a request's n samples, and the requests that send
    the same prompt (a GRPO group's rollouts arrive as one request each; on a CPU, prefilling each
    copy made a wave of 4 prompts x 8 rollouts 1.4x slower). Every step samples each request's rows
    with that request's own parameters and RNG, so a request's numbers do not depend on what it was
    batched with (up to float rounding of the padded matmuls). Finished or cancelled rows leave the
    batch. Every tensor lives on the model's device; the forward passes run inside ``autocast()``
    (the model's precision).
    """
    device = next((parameter.device for parameter in model.parameters()), torch.device("cpu"))
    states = [[SequenceState(index, tokenizer, request.params, eos_ids) for index in range(request.params.n)]
              for request in requests]
    generators = [make_generator(request.params.seed, device) for request in requests]
    with torch.inference_mode(), autocast():
        distinct: dict[tuple[int, ...], int] = {}
        prompt_of = [distinct.setdefault(tuple(request.prompt_ids), len(distinct)) for request in requests]
        cache, logits, mask, next_position = _prefill(model, list(distinct), pad_id, device)
        owner = [number for number, request in enumerate(requests) for _ in range(request.params.n)]
        index = [sample for request in requests for sample in range(request.params.n)]
        expand = torch.tensor([prompt_of[number] for number in owner], dtype=torch.long, device=device)
        cache.batch_select_indices(expand)
        logits, mask, next_position = logits[expand], mask[expand], next_position[expand]
        while owner:
            ids = torch.empty(len(owner), dtype=torch.long, device=device)
            rows_of: dict[int, list[int]] = {}
            for row, number in enumerate(owner):
                rows_of.setdefault(number, []).append(row)
            for number, rows in rows_of.items():
                request = requests[number]
                chosen, logprobs = sample(logits[rows], request.params, generators[number])
                ids[rows] = chosen
                entries = (token_logprobs(chosen, logprobs, request.params.top_logprobs) if request.params.logprobs
                           else [None] * len(rows))
                request.emit([states[number][index[row]].append(token_id, entry)
                              for row, token_id, entry in zip(rows, chosen.tolist(), entries, strict=True)])
            stopped = {number for number in rows_of if requests[number].cancelled()}
            keep = [row for row, number in enumerate(owner)
                    if number not in stopped and not states[number][index[row]].finished]
            if not keep:
                break
            if len(keep) < len(owner):
                selected = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(selected)
                ids, mask, next_position = ids[selected], mask[selected], next_position[selected]
                owner, index = [owner[row] for row in keep], [index[row] for row in keep]
            mask = torch.cat([mask, torch.ones((len(owner), 1), dtype=torch.long, device=device)], dim=1)
            output = model(input_ids=ids[:, None], attention_mask=mask, position_ids=next_position[:, None],
                           past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, logits, next_position = output.past_key_values, output.logits[:, -1, :], next_position + 1
    return states

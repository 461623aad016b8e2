"""The dev server's decode loop: KV-cached sampling of n sequences per prompt, with exact logprobs.

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
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

import torch

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
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1), logprobs


def token_logprobs(ids: torch.Tensor, logprobs: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Per-row TokenLogprob of the sampled ids, with the ``top`` most likely alternatives."""
    chosen = logprobs.gather(-1, ids[:, None]).squeeze(-1).tolist()
    if top > 0:
        best = torch.topk(logprobs, top, dim=-1)
        alternatives = [tuple(zip(row_ids, row_lps)) for row_ids, row_lps
                        in zip(best.indices.tolist(), best.values.tolist())]
    else:
        alternatives = [()] * len(chosen)
    return [TokenLogprob(token_id, logprob, alts)
            for token_id, logprob, alts in zip(ids.tolist(), chosen, alternatives)]


def make_generator(seed: int | None) -> torch.Generator:
    """A private RNG: seeded for reproducible sampling, else from system entropy."""
    return torch.Generator().manual_seed(random.SystemRandom().getrandbits(63) if seed is None else seed % 2**63)


def generate(model: torch.nn.Module, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams,
             eos_ids: Collection[int], emit: Callable[[list[Delta]], None],
             cancelled: Callable[[], bool] = lambda: False) -> list[SequenceState]:
    """Sample ``params.n`` continuations of one prompt together, calling ``emit`` after every step.

    The prompt is prefilled once and its KV cache repeated for the n samples; finished sequences
    leave the batch. Runs synchronously (call it from a worker thread); ``cancelled`` is polled
    between steps so an abandoned request stops early.
    """
    sequences = [SequenceState(index, tokenizer, params, eos_ids) for index in range(params.n)]
    generator = make_generator(params.seed)
    with torch.inference_mode():
        output = model(input_ids=torch.tensor([list(prompt_ids)], dtype=torch.long),
                       use_cache=True, logits_to_keep=1)
        cache = output.past_key_values
        logits = output.logits[:, -1, :]
        if params.n > 1:
            cache.batch_repeat_interleave(params.n)
            logits = logits.expand(params.n, -1)
        rows = list(range(params.n))  # batch row -> sequence index
        while rows and not cancelled():
            ids, logprobs = sample(logits, params, generator)
            entries = token_logprobs(ids, logprobs, params.top_logprobs) if params.logprobs else [None] * len(rows)
            emit([sequences[index].append(token_id, entry)
                  for index, token_id, entry in zip(rows, ids.tolist(), entries)])
            keep = [row for row, index in enumerate(rows) if not sequences[index].finished]
            if not keep:
                break
            if len(keep) < len(rows):
                selected = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(selected)
                ids = ids[selected]
                rows = [rows[row] for row in keep]
            output = model(input_ids=ids[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = output.past_key_values
            logits = output.logits[:, -1, :]
    return sequences

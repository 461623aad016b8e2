"""Model servers for tests: a scripted model, the exactness check of token ids and logprobs, and requests."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import torch

from agentstream.models import LoadedModel, load_model, teacher_forced_logprobs, tiny_tokenizer

TOLERANCE = 1e-4
HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def assert_exact(loaded: LoadedModel, model: torch.nn.Module, prompt_ids: list[int], token_ids: list[int],
                 text: str | None, logprobs: list[float], temperature: float) -> None:
    """THE contract: ids decode to the text, and the logprobs are what a teacher-forced forward recomputes."""
    assert token_ids, "no tokens generated"
    if text is not None:
        assert loaded.tokenizer.decode(token_ids, skip_special_tokens=True) == text
    assert len(logprobs) == len(token_ids)
    expected = teacher_forced_logprobs(model, prompt_ids, token_ids, temperature)
    assert max(abs(a - b) for a, b in zip(expected, logprobs, strict=True)) < TOLERANCE


def scripted(text: str, gate: threading.Event | None = None) -> LoadedModel:
    """A server model that writes ``text`` then EOS whatever the prompt, optionally pausing after its first token."""
    tokenizer = tiny_tokenizer()
    return LoadedModel(model=ScriptedLM([*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id],
                                        len(tokenizer), gate),
                       tokenizer=tokenizer, name="scripted", dtype=torch.float32)


class ScriptedCache:
    """Stands in for a KV cache: only counts steps."""

    def __init__(self, step: int):
        self.step = step

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        pass


class ScriptedLM(torch.nn.Module):
    """A causal-LM look-alike whose next token is scripted, so a test can force tool calls and pacing."""

    def __init__(self, script: list[int], vocab_size: int, gate: threading.Event | None):
        super().__init__()
        self.script, self.vocab_size, self.gate = script, vocab_size, gate
        self.config = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=4096, eos_token_id=script[-1])
        self.generation_config = SimpleNamespace(eos_token_id=script[-1])

    def forward(self, input_ids, past_key_values=None, **kwargs):
        step = 0 if past_key_values is None else past_key_values.step + 1
        if step >= 1 and self.gate is not None:
            assert self.gate.wait(timeout=20), "the test never opened the gate"
        logits = torch.full((input_ids.shape[0], 1, self.vocab_size), -30.0)
        logits[:, :, self.script[min(step, len(self.script) - 1)]] = 30.0
        return SimpleNamespace(logits=logits, past_key_values=ScriptedCache(step))


def make_lora(folder: Path, seed: int = 0) -> torch.nn.Module:
    """A non-zero peft LoRA on a fresh tiny model, saved to ``folder``; returns the peft model for reference.

    Adapters made with different seeds differ (their answers too)."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        peft_model = get_peft_model(load_model("tiny").model, LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    peft_model.save_pretrained(folder)
    return peft_model.eval()

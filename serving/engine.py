"""The model server's state, shared by every handler: the model, its LoRA adapters, the policy version and the batcher.

It also turns generated tokens into OpenAI's logprob and usage shapes, since those need the
tokenizer and a cache of each token's text.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from agentstream.models import LoadedModel, context_length, eos_token_ids
from agentstream.serving.attention import use_grouped_attention
from agentstream.serving.batcher import Batcher, Job
from agentstream.serving.generation import Delta, SequenceState, TokenLogprob
from agentstream.serving.lora import LoraAdapter
from agentstream.serving.protocol import LOGPROB_FLOOR, RequestError
from agentstream.serving.tool_format import renders_tools


class ModelServer:
    """State shared by the handlers: the model, its adapters, the weights version and the generation batcher."""

    def __init__(self, loaded: LoadedModel, served_model_names: Sequence[str] = (),
                 max_tokens: int | None = None) -> None:
        self.loaded = loaded
        use_grouped_attention(loaded.model)
        self.names = tuple(served_model_names) or (loaded.name,)  # the base model's names (vLLM's aliases)
        self.name = self.names[0]
        self.default_max_tokens = max_tokens or None  # a chat request naming none gets this (None: up to the context)
        self.version = 0
        self.adapters: dict[str, LoraAdapter] = {}
        self.eos_ids = eos_token_ids(loaded)
        self.pad_id = loaded.tokenizer.pad_token_id or 0
        self.context = context_length(loaded.model)
        config: Any = loaded.model.config
        self.vocab_size = int(config.vocab_size)
        self.template_renders_tools = renders_tools(loaded.tokenizer)
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}
        self.batcher = Batcher(loaded, self.eos_ids, self.pad_id, self.version_of)

    # -- lookups

    def adapter(self, model: Any) -> LoraAdapter | None:
        """The adapter a request's ``model`` names (None for the base model); unknown names are a 404."""
        if model is None or model == "" or model in self.names:
            return None
        if isinstance(model, str) and model in self.adapters:
            return self.adapters[model]
        raise RequestError(f"The model `{model}` does not exist.", status=404, param="model")

    def version_of(self, adapter: LoraAdapter | None) -> int:
        """The policy version a request on this adapter (or the base model) is served with."""
        return self.version if adapter is None else adapter.version

    def token_text(self, token_id: int) -> str:
        """A token's text as vLLM shows it in logprobs (its own decode; partial characters may be empty or U+FFFD)."""
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.loaded.tokenizer
            text = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])
            self._token_texts[token_id] = text
        return text

    # -- generation

    async def complete(self, job: Job) -> list[SequenceState]:
        """Generate a whole job (batched with whatever else is waiting)."""
        return await asyncio.wrap_future(self.batcher.submit(job))

    async def stream(self, job: Job) -> AsyncGenerator[list[Delta], None]:
        """Yield each step's deltas as the generation thread produces them.

        Closing the iterator early (client gone) drops the job's rows from its batch and waits
        for that to take effect.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[Delta] | None] = asyncio.Queue()  # None: the job is done
        stop = threading.Event()

        def emit(deltas: list[Delta]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, deltas)

        future = self.batcher.submit(job, emit, stop.is_set)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        try:
            while (deltas := await queue.get()) is not None:
                yield deltas
            future.result()
        finally:
            stop.set()
            await asyncio.wait([asyncio.wrap_future(future)])

    # -- response pieces

    def chat_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """OpenAI chat logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""
        return {"content": [{**self._logprob(entry.token_id, entry.logprob),
                             "top_logprobs": [self._logprob(i, lp) for i, lp in entry.top]} for entry in entries]}

    def _logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR),
                "bytes": list(text.encode("utf-8", errors="replace"))}

    def completion_logprobs(self, entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
        """OpenAI completions logprobs; ``top_logprobs`` hold the top alternatives plus the sampled token."""
        tokens, offsets = [], []
        for entry in entries:
            tokens.append(self.token_text(entry.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [max(entry.logprob, LOGPROB_FLOOR) for entry in entries],
            "top_logprobs": [{self.token_text(i): max(lp, LOGPROB_FLOOR)
                              for i, lp in (*entry.top, (entry.token_id, entry.logprob))} for entry in entries],
            "text_offset": offsets,
        }

    def usage(self, job: Job, completion_tokens: int) -> dict[str, int]:
        """OpenAI usage counts."""
        prompt_tokens = len(job.prompt_ids)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

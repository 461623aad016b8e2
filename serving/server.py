"""The dev model server: vLLM's OpenAI-compatible HTTP contract over transformers, for CPU machines.

The proxy, runners and trainer talk to this server exactly as they talk to vLLM (>= 0.10.2):
``/v1/chat/completions`` and ``/v1/completions`` (streaming too) with vLLM's ``return_token_ids``
(top-level ``prompt_token_ids`` and ``choices[i].token_ids``; completions put
``prompt_token_ids`` on each choice), ``/v1/models``, ``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter`` and ``/health``. The dev server adds ``/v1/load_weights`` for
full-weight updates and an ``X-Policy-Version`` header on every response.

Choices where vLLM's behaviour needed pinning down (see ``generation`` for logprobs and text):
- ``token_ids`` hold every sampled id, a final EOS or stop-token id included, like vLLM; the
  text is their decode with special tokens skipped. A stop string ends the text before it
  (``finish_reason`` "stop", ``stop_reason`` the string) while ``token_ids`` keep the tokens
  that spelled it, so for stop-string endings the ids decode to more than the text.
  ``finish_reason`` is "stop" for EOS (``stop_reason`` null), stop strings and stop token ids
  (``stop_reason`` the id), "length" at max_tokens, "tool_calls" when tool calls were parsed.
- Errors are vLLM's shape: ``{"error": {"message", "type", "param", "code"}}`` with code the
  HTTP status (400 BadRequestError, 404 NotFoundError for an unknown model or adapter).
- Requests that wait together are generated together: one thread runs one batch at a time,
  taking every queued request on the same adapter (prompts left-padded, each request sampled
  with its own parameters and RNG). Rollouts of a GRPO group and evaluation sweeps arrive
  together, so this is what makes a CPU server usable for RL. ``load_weights`` waits for the
  batch in progress to finish on the old weights; batches after it run on the new ones, and
  ``X-Policy-Version`` is the version the request's batch ran with.
- ``tool_choice`` "required" or a named function is treated like "auto" (no constrained
  decoding); "none" renders the tools but does not parse tool calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from serving.generation import (
    BatchRequest,
    Delta,
    SamplingParams,
    SequenceState,
    TokenLogprob,
    generate_batch,
)
from serving.lora import LoraAdapter, LoraError, LoraNotFound, applied, load_lora
from models import (
    LoadedModel,
    WeightsError,
    assign_weights,
    check_weights,
    context_length,
    eos_token_ids,
    read_weights,
)
from serving.tool_format import (
    PromptError,
    ToolStreamFilter,
    parse_tool_calls,
    render_prompt,
    renders_tools,
)

log = logging.getLogger("agentstream.model_server")

VERSION_HEADER = "X-Policy-Version"
MAX_N = 64
MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs
GREEDY_BELOW = 1e-5  # vLLM treats smaller temperatures as greedy
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf so the JSON stays valid
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 500: "InternalServerError"}


class RequestError(Exception):
    """A request the server refuses, rendered as an OpenAI/vLLM-style error body."""

    def __init__(self, message: str, status: int = 400, error_type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type or ERROR_TYPES.get(status, "BadRequestError")
        self.param = param


def error_response(status: int, message: str, error_type: str | None = None, param: str | None = None) -> web.Response:
    """vLLM's error body: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": error_type or ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}
    return web.json_response(body, status=status)


# ---------------------------------------------------------------- request fields


def _value(body: dict, name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    """``body[name]`` if present and of an accepted type (bools are not numbers), else ``default``."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise RequestError(f"'{name}' must be {what}", param=name)
    return value


def _int(body: dict, name: str, default: int | None, low: int | None = None, high: int | None = None) -> int | None:
    """An optional integer field within [low, high]."""
    value = _value(body, name, (int,), default, "an integer")
    if value is not None and (low is not None and value < low or high is not None and value > high):
        raise RequestError(f"'{name}' must be between {low} and {high}" if high is not None
                           else f"'{name}' must be at least {low}", param=name)
    return value


def _float(body: dict, name: str, default: float, low: float, high: float | None = None) -> float:
    """An optional number field within [low, high]."""
    value = float(_value(body, name, (int, float), default, "a number"))
    if value < low or high is not None and value > high:
        raise RequestError(f"'{name}' must be in [{low}, {high if high is not None else 'inf'}]", param=name)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    """An optional boolean field."""
    return _value(body, name, (bool,), default, "true or false")


def _str(body: dict, name: str) -> str:
    """A required non-empty string field."""
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{name}' is required and must be a non-empty string", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    """The stop strings: one string or a list of them."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(item, str) for item in stop):
        return tuple(item for item in stop if item)
    raise RequestError("'stop' must be a string or a list of strings", param="stop")


def _token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    """A list of token ids inside the vocabulary."""
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise RequestError(f"'{name}' must be a list of token ids", param=name)
    if any(not 0 <= i < vocab_size for i in value):
        raise RequestError(f"'{name}' has token ids outside the vocabulary [0, {vocab_size})", param=name)
    return value


@dataclass(frozen=True)
class Output:
    """What the client asked to see besides text: token ids, logprobs, streaming and usage."""

    return_token_ids: bool
    logprobs: bool
    stream: bool
    include_usage: bool


def _output(body: dict, logprobs: bool) -> Output:
    """The output options of a request (stream_options only with stream, as vLLM insists)."""
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise RequestError("'stream_options' must be an object and needs 'stream': true", param="stream_options")
    return Output(return_token_ids=_bool(body, "return_token_ids", False), logprobs=logprobs, stream=stream,
                  include_usage=bool(options and _bool(options, "include_usage", False)))


def sampling_params(body: dict, *, prompt_tokens: int, context: int, default_max_tokens: int | None,
                    logprobs: bool, top_logprobs: int) -> SamplingParams:
    """vLLM's sampling fields of a request, checked against the room left in the model's context."""
    room = context - prompt_tokens
    if room <= 0:
        raise RequestError(f"This model's maximum context length is {context} tokens. However, your request has "
                           f"{prompt_tokens} input tokens. Please reduce the length of the input.")
    max_tokens = _int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, 1)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise RequestError(f"This model's maximum context length is {context} tokens. However, you requested "
                           f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the input, {max_tokens} in the "
                           "completion). Please reduce the length of the input or completion.", param="max_tokens")
    temperature = _float(body, "temperature", 1.0, 0.0)
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(isinstance(i, int) for i in stop_token_ids):
        raise RequestError("'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=_float(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=_int(body, "top_k", 0, -1),
        n=_int(body, "n", 1, 1, MAX_N),
        seed=_int(body, "seed", None),
        stop=_stop(body),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


async def _json_body(request: web.Request) -> dict:
    """The request body as a JSON object, or a 400."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


# ---------------------------------------------------------------- the server


@dataclass
class Job:
    """One generation request, resolved: which adapter, which prompt, how to sample, what to return."""

    model_name: str
    adapter: LoraAdapter | None
    prompt_ids: list[int]
    params: SamplingParams
    output: Output
    version: int | None = None  # the policy version its batch ran with, set when the batch starts


@dataclass
class _Queued:
    job: Job
    emit: Callable[[list[Delta]], None]
    cancelled: Callable[[], bool]
    future: Future


class Batcher:
    """The generation thread: runs the queued requests on one adapter as one batch, one batch at a time.

    ``model_lock`` is held for a whole batch; weight updates take it too, so a batch never sees
    half-assigned weights. After the first request of an idle spell arrives the thread waits
    ``window_s`` for the rest of its burst (the other rollouts of a group arrive milliseconds apart).
    """

    def __init__(self, server: ModelServer, max_sequences: int = 64, window_s: float = 0.01):
        self.server = server
        self.max_sequences = max_sequences
        self.window_s = window_s
        self.model_lock = threading.Lock()
        self._queue: deque[_Queued] = deque()
        self._wakeup = threading.Condition()
        self._closed = False
        self.batch_sizes: Counter[int] = Counter()  # requests per batch -> batches run
        self._thread = threading.Thread(target=self._run, name="generation", daemon=True)
        self._thread.start()

    def submit(self, job: Job, emit: Callable[[list[Delta]], None] = lambda deltas: None,
               cancelled: Callable[[], bool] = lambda: False) -> Future:
        """Queue a job; the future resolves to its sequences (or the generation's exception)."""
        queued = _Queued(job, emit, cancelled, Future())
        with self._wakeup:
            if self._closed:
                raise RuntimeError("the model server is shutting down")
            self._queue.append(queued)
            self._wakeup.notify()
        return queued.future

    def close(self) -> None:
        """Stop taking batches; the one running finishes, queued requests fail."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        self._thread.join()
        for queued in self._queue:
            queued.future.set_exception(RuntimeError("the model server shut down"))

    def _next_batch(self) -> list[_Queued]:
        with self._wakeup:
            while not self._queue and not self._closed:
                self._wakeup.wait()
            if self._closed:
                return []
        time.sleep(self.window_s)
        with self._wakeup:
            adapter = self._queue[0].job.adapter
            batch, rest, rows = [], deque(), 0
            for queued in self._queue:
                fits = not batch or rows + queued.job.params.n <= self.max_sequences
                if queued.job.adapter is adapter and fits:
                    batch.append(queued)
                    rows += queued.job.params.n
                else:
                    rest.append(queued)
            self._queue = rest
        return batch

    def _run(self) -> None:
        while batch := self._next_batch():
            loaded = self.server.loaded
            with self.model_lock:
                for queued in batch:
                    queued.job.version = self.server.version_of(queued.job.adapter)
                self.batch_sizes[len(batch)] += 1
                requests = [BatchRequest(q.job.prompt_ids, q.job.params, q.emit, q.cancelled) for q in batch]
                try:
                    with applied(batch[0].job.adapter, loaded.model):
                        results = generate_batch(loaded.model, loaded.tokenizer, requests, self.server.eos_ids,
                                                 self.server.pad_id)
                except Exception as error:
                    log.exception("generation failed for a batch of %d requests", len(batch))
                    for queued in batch:
                        queued.future.set_exception(error)
                    continue
            for queued, sequences in zip(batch, results):
                queued.future.set_result(sequences)


class ModelServer:
    """State shared by the handlers: the model, its adapters, the weights version and the generation batcher."""

    def __init__(self, loaded: LoadedModel, served_model_name: str | None = None):
        self.loaded = loaded
        self.name = served_model_name or loaded.name
        self.version = 0
        self.adapters: dict[str, LoraAdapter] = {}
        self.eos_ids = eos_token_ids(loaded)
        self.pad_id = loaded.tokenizer.pad_token_id or 0
        self.context = context_length(loaded.model)
        self.vocab_size = int(loaded.model.config.vocab_size)
        self.template_renders_tools = renders_tools(loaded.tokenizer)
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}
        self.batcher = Batcher(self)

    # -- lookups

    def adapter(self, model: Any) -> LoraAdapter | None:
        """The adapter a request's ``model`` names (None for the base model); unknown names are a 404."""
        if model is None or model == "" or model == self.name:
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

    async def stream(self, job: Job) -> AsyncIterator[list[Delta]]:
        """Yield each step's deltas as the generation thread produces them.

        Closing the iterator early (client gone) drops the job's rows from its batch and waits
        for that to take effect.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        done = object()
        future = self.batcher.submit(job, lambda deltas: loop.call_soon_threadsafe(queue.put_nowait, deltas),
                                     stop.is_set)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, done))
        try:
            while (item := await queue.get()) is not done:
                yield item
            future.result()
        finally:
            stop.set()
            await asyncio.wait([asyncio.wrap_future(future)])

    # -- response pieces

    def chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        """OpenAI chat logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""
        return {"content": [{**self._logprob(entry.token_id, entry.logprob),
                             "top_logprobs": [self._logprob(i, lp) for i, lp in entry.top]} for entry in entries]}

    def _logprob(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR),
                "bytes": list(text.encode("utf-8", errors="replace"))}

    def completion_logprobs(self, entries: list[TokenLogprob], offset: int) -> dict:
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

    def usage(self, job: Job, completion_tokens: int) -> dict:
        """OpenAI usage counts."""
        prompt_tokens = len(job.prompt_ids)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}


SERVER = web.AppKey("model_server", ModelServer)


def _sse(payload: dict | str) -> bytes:
    """One server-sent event line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _open_stream(request: web.Request, version: int) -> web.StreamResponse:
    """Send the headers of an SSE response stamped with the policy version."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           VERSION_HEADER: str(version)})
    await response.prepare(request)
    return response


# ---------------------------------------------------------------- chat completions


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    server = request.app[SERVER]
    body = await _json_body(request)
    adapter = server.adapter(body.get("model"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise RequestError("'messages' must be a non-empty list of objects with a 'role'", param="messages")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str) for t in tools)):
        raise RequestError("'tools' must be a list of {'type': 'function', 'function': {'name', ...}}", param="tools")
    tool_choice = body.get("tool_choice", "auto" if tools else "none")
    if tool_choice not in ("none", "auto", "required") and not isinstance(tool_choice, dict):
        raise RequestError("'tool_choice' must be 'none', 'auto', 'required' or a named function", param="tool_choice")
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise RequestError("when using 'top_logprobs', 'logprobs' must be set to true", param="top_logprobs")
    try:
        prompt_ids = render_prompt(server.loaded.tokenizer, messages, tools, server.template_renders_tools)
    except PromptError as error:
        raise RequestError(str(error), param="messages") from None
    params = sampling_params(body, prompt_tokens=len(prompt_ids), context=server.context, default_max_tokens=None,
                             logprobs=logprobs, top_logprobs=top_logprobs)
    job = Job(model_name=body.get("model") or server.name, adapter=adapter, prompt_ids=prompt_ids, params=params,
              output=_output(body, logprobs))
    parse_tools = bool(tools) and tool_choice != "none"
    if job.output.stream:
        return await _stream_chat(request, server, job, parse_tools)
    sequences = await server.complete(job)
    choices = [_chat_choice(server, job, sequence, parse_tools) for sequence in sequences]
    response = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": job.model_name, "choices": choices,
                "usage": server.usage(job, sum(len(s.token_ids) for s in sequences))}
    if job.output.return_token_ids:
        response["prompt_token_ids"] = job.prompt_ids
    return web.json_response(response, headers={VERSION_HEADER: str(job.version)})


def _chat_choice(server: ModelServer, job: Job, sequence: SequenceState, parse_tools: bool) -> dict:
    """One choice of a non-streamed chat completion."""
    content: str | None = sequence.text
    tool_calls: list[dict] = []
    if parse_tools:
        parsed = parse_tool_calls(sequence.text)
        content, tool_calls = parsed.content, parsed.tool_calls
    choice = {"index": sequence.index,
              "message": {"role": "assistant", "content": content, "tool_calls": tool_calls},
              "logprobs": server.chat_logprobs(sequence.logprobs) if job.output.logprobs else None,
              "finish_reason": "tool_calls" if tool_calls else sequence.finish_reason,
              "stop_reason": sequence.stop_reason}
    if job.output.return_token_ids:
        choice["token_ids"] = sequence.token_ids
    return choice


async def _stream_chat(request: web.Request, server: ModelServer, job: Job, parse_tools: bool) -> web.StreamResponse:
    """SSE chat.completion.chunk events, one per choice per generated token, then usage and [DONE]."""
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[dict], **extra: Any) -> dict:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                "model": job.model_name, "choices": choices, **extra}

    filters = [ToolStreamFilter() for _ in range(job.params.n)] if parse_tools else None
    response: web.StreamResponse | None = None
    completion_tokens = 0
    try:
        async with aclosing(server.stream(job)) as steps:
            async for deltas in steps:
                if response is None:  # the batch started: its policy version is known
                    response = await _open_stream(request, job.version)
                    for index in range(job.params.n):
                        first = {"prompt_token_ids": job.prompt_ids} if job.output.return_token_ids and index == 0 else {}
                        await response.write(_sse(chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}], **first)))
                for delta in deltas:
                    completion_tokens += len(delta.token_ids)
                    tool_filter = filters[delta.index] if filters else None
                    await response.write(_sse(chunk([_chat_stream_choice(server, job, delta, tool_filter)])))
        if job.output.include_usage:
            await response.write(_sse(chunk([], usage=server.usage(job, completion_tokens))))
    except ConnectionResetError:
        return response
    except Exception as error:
        if response is None:  # nothing sent yet: a plain error response
            raise
        log.exception("chat stream failed")  # headers are sent: report in-band, as vLLM does
        await response.write(_sse({"error": {"message": str(error), "type": "InternalServerError",
                                             "param": None, "code": 500}}))
    await response.write(_sse("[DONE]"))
    await response.write_eof()
    return response


def _chat_stream_choice(server: ModelServer, job: Job, delta: Delta, tool_filter: ToolStreamFilter | None) -> dict:
    """One choice of a chat chunk; tool calls are parsed and sent when the sequence ends."""
    finish_reason = delta.finish_reason
    message: dict[str, Any] = {"content": delta.text}
    if tool_filter is not None:
        message["content"] = tool_filter.feed(delta.text)
        if finish_reason is not None:
            rest, calls = tool_filter.finish()
            message["content"] += rest
            if calls:
                message["tool_calls"] = [{"index": number, **call} for number, call in enumerate(calls)]
                finish_reason = "tool_calls"
    choice = {"index": delta.index, "delta": message,
              "logprobs": server.chat_logprobs(delta.logprobs) if job.output.logprobs else None,
              "finish_reason": finish_reason, "stop_reason": delta.stop_reason}
    if job.output.return_token_ids:
        choice["token_ids"] = delta.token_ids
    return choice


# ---------------------------------------------------------------- completions


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions (one prompt: a string or a list of token ids)."""
    server = request.app[SERVER]
    body = await _json_body(request)
    adapter = server.adapter(body.get("model"))
    if _bool(body, "echo", False):
        raise RequestError("'echo' is not supported by the dev model server", param="echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        prompt_ids = list(server.loaded.tokenizer(
            prompt, add_special_tokens=_bool(body, "add_special_tokens", True)).input_ids)
    else:
        prompt_ids = _token_ids(prompt, "prompt", server.vocab_size)
    if not prompt_ids:
        raise RequestError("the prompt must not be empty", param="prompt")
    top_logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    params = sampling_params(body, prompt_tokens=len(prompt_ids), context=server.context,
                             default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
                             logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0)
    job = Job(model_name=body.get("model") or server.name, adapter=adapter, prompt_ids=prompt_ids, params=params,
              output=_output(body, top_logprobs is not None))
    if job.output.stream:
        return await _stream_completion(request, server, job)
    sequences = await server.complete(job)
    choices = []
    for sequence in sequences:
        choice = {"index": sequence.index, "text": sequence.text,
                  "logprobs": server.completion_logprobs(sequence.logprobs, 0) if job.output.logprobs else None,
                  "finish_reason": sequence.finish_reason, "stop_reason": sequence.stop_reason}
        if job.output.return_token_ids:
            choice.update(prompt_token_ids=job.prompt_ids, token_ids=sequence.token_ids)
        choices.append(choice)
    response = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": job.model_name, "choices": choices,
                "usage": server.usage(job, sum(len(s.token_ids) for s in sequences))}
    return web.json_response(response, headers={VERSION_HEADER: str(job.version)})


async def _stream_completion(request: web.Request, server: ModelServer, job: Job) -> web.StreamResponse:
    """SSE text_completion events, one per choice per generated token, then usage and [DONE]."""
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    offsets = [0] * job.params.n
    first = [True] * job.params.n
    response: web.StreamResponse | None = None
    completion_tokens = 0
    try:
        async with aclosing(server.stream(job)) as steps:
            async for deltas in steps:
                if response is None:
                    response = await _open_stream(request, job.version)
                for delta in deltas:
                    completion_tokens += len(delta.token_ids)
                    choice = {"index": delta.index, "text": delta.text,
                              "logprobs": (server.completion_logprobs(delta.logprobs, offsets[delta.index])
                                           if job.output.logprobs else None),
                              "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
                    offsets[delta.index] += sum(len(server.token_text(i)) for i in delta.token_ids)
                    if job.output.return_token_ids:
                        if first[delta.index]:
                            choice["prompt_token_ids"] = job.prompt_ids
                        choice["token_ids"] = delta.token_ids
                    first[delta.index] = False
                    await response.write(_sse({"id": completion_id, "object": "text_completion",
                                               "created": created, "model": job.model_name,
                                               "choices": [choice]}))
        if job.output.include_usage:
            await response.write(_sse({"id": completion_id, "object": "text_completion", "created": created,
                                       "model": job.model_name, "choices": [],
                                       "usage": server.usage(job, completion_tokens)}))
    except ConnectionResetError:
        return response
    except Exception as error:
        if response is None:
            raise
        log.exception("completion stream failed")
        await response.write(_sse({"error": {"message": str(error), "type": "InternalServerError",
                                             "param": None, "code": 500}}))
    await response.write(_sse("[DONE]"))
    await response.write_eof()
    return response


# ---------------------------------------------------------------- models, adapters, weights, health


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the base model and the loaded LoRA adapters (with ``parent``), as vLLM lists them."""
    server = request.app[SERVER]
    base = {"id": server.name, "object": "model", "created": server.created, "owned_by": "agentstream",
            "root": server.loaded.source or server.name, "parent": None, "max_model_len": server.context,
            "permission": []}
    adapters = [{"id": name, "object": "model", "created": server.created, "owned_by": "agentstream",
                 "root": adapter.path, "parent": server.name, "max_model_len": None, "permission": []}
                for name, adapter in server.adapters.items()]
    return web.json_response({"object": "list", "data": [base, *adapters]})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path", "version"?, "load_inplace"?}."""
    server = request.app[SERVER]
    body = await _json_body(request)
    if not body.get("lora_name") or not body.get("lora_path"):
        raise RequestError("Both 'lora_name' and 'lora_path' must be provided.", error_type="InvalidUserInput")
    name, path = _str(body, "lora_name"), _str(body, "lora_path")
    version = _int(body, "version", 0, 0)
    if name == server.name:
        raise RequestError(f"'{name}' is the base model's name", error_type="InvalidUserInput", param="lora_name")
    if name in server.adapters and not _bool(body, "load_inplace", False):
        raise RequestError(f"The lora adapter '{name}' has already been loaded.", error_type="InvalidUserInput")
    try:
        adapter = await asyncio.to_thread(load_lora, Path(path), server.loaded.model, name, version)
    except LoraNotFound as error:
        raise RequestError(str(error), status=404) from None
    except LoraError as error:
        raise RequestError(str(error)) from None
    server.adapters[name] = adapter
    log.info("loaded LoRA adapter %s from %s (version %d)", name, path, version)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/unload_lora_adapter {"lora_name"}; requests already running keep their adapter."""
    server = request.app[SERVER]
    body = await _json_body(request)
    name = _str(body, "lora_name")
    if server.adapters.pop(name, None) is None:
        raise RequestError(f"The lora adapter '{name}' cannot be found.", status=404)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def load_weights(request: web.Request) -> web.Response:
    """POST /v1/load_weights {"path", "version"}: swap the base weights once the running generation ends."""
    server = request.app[SERVER]
    body = await _json_body(request)
    path = Path(_str(body, "path"))
    version = _int(body, "version", None, 0)
    if version is None:
        raise RequestError("'version' is required (an integer)", param="version")
    started = time.perf_counter()
    try:
        state = await asyncio.to_thread(read_weights, path)
        check_weights(server.loaded.model, state)
    except WeightsError as error:
        raise RequestError(str(error), param="path") from None

    def swap() -> None:
        with server.batcher.model_lock:
            assign_weights(server.loaded.model, state)
            server.version = version

    await asyncio.to_thread(swap)
    seconds = round(time.perf_counter() - started, 3)
    log.info("loaded weights version %d from %s in %.3f s", version, path, seconds)
    return web.json_response({"status": "ok", "version": version, "path": str(path), "seconds": seconds})


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 while the server runs."""
    return web.Response(status=200)


@web.middleware
async def _errors_and_version(request: web.Request, handler) -> web.StreamResponse:
    """Render refusals as vLLM-style errors and stamp X-Policy-Version on every response."""
    try:
        response = await handler(request)
    except RequestError as error:
        response = error_response(error.status, str(error), error.error_type, error.param)
    except web.HTTPException as error:
        response = error_response(error.status, error.reason)
    except Exception as error:
        log.exception("request failed: %s %s", request.method, request.path)
        response = error_response(500, f"internal error: {error}")
    if not response.prepared:
        response.headers.setdefault(VERSION_HEADER, str(request.app[SERVER].version))
    return response


def create_app(loaded: LoadedModel, *, served_model_name: str | None = None) -> web.Application:
    """The aiohttp application serving ``loaded`` (used by ``serve`` and by tests)."""
    loaded.model.eval()
    server = ModelServer(loaded, served_model_name)
    app = web.Application(middlewares=[_errors_and_version], client_max_size=64 * 1024 * 1024)
    app[SERVER] = server
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/v1/load_weights", load_weights)
    app.router.add_get("/health", health)

    async def stop_generation(app: web.Application) -> None:
        await asyncio.to_thread(server.batcher.close)

    app.on_cleanup.append(stop_generation)
    return app


async def serve(loaded: LoadedModel, *, host: str = "127.0.0.1", port: int = 8000,
                served_model_name: str | None = None) -> None:
    """Serve until cancelled."""
    runner = web.AppRunner(create_app(loaded, served_model_name=served_model_name), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("serving %s at http://%s:%d/v1", served_model_name or loaded.name, host, port)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()

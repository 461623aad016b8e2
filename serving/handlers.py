"""One aiohttp handler per endpoint of the dev model server, each answering exactly as vLLM (>= 0.10.2) does.

Choices where vLLM's behaviour needed pinning down (see ``generation`` for logprobs and text):
- ``token_ids`` hold every sampled id, a final EOS or stop-token id included, like vLLM; the
  text is their decode with special tokens skipped. A stop string ends the text before it
  (``finish_reason`` "stop", ``stop_reason`` the string) while ``token_ids`` keep the tokens
  that spelled it, so for stop-string endings the ids decode to more than the text.
  ``finish_reason`` is "stop" for EOS (``stop_reason`` null), stop strings and stop token ids
  (``stop_reason`` the id), "length" at max_tokens, "tool_calls" when tool calls were parsed.
- A generation notes the policy version its batch ran with (``SERVED_VERSION``); the dev
  contract stamps it as ``X-Policy-Version``, the vLLM contract sends no version at all.
- ``tool_choice`` "required" or a named function is treated like "auto" (no constrained
  decoding); "none" renders the tools but does not parse tool calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

from aiohttp import web

from agentstream.models import WeightsError, assign_weights, check_weights, read_weights
from agentstream.schemas.contracts import openai_error_body
from agentstream.schemas.responses_api import ResponsesAnswer, ResponsesRequestError, chat_request
from agentstream.serving.batcher import Job
from agentstream.serving.engine import ModelServer
from agentstream.serving.generation import Delta, SequenceState
from agentstream.serving.lora import LoraError, LoraNotFound, load_lora
from agentstream.serving.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    Contract,
    RequestError,
    bool_field,
    int_field,
    json_body,
    output_options,
    sampling_params,
    str_field,
    token_ids_field,
)
from agentstream.serving.tool_format import PromptError, ToolStreamFilter, parse_tool_calls, render_prompt

log = logging.getLogger("agentstream.model_server")

SERVER = web.AppKey("model_server", ModelServer)
"""Where the handlers find the server's state in the application."""

CONTRACT = web.AppKey("contract", Contract)
"""The HTTP contract the application serves."""

SERVED_VERSION: web.RequestKey[int | None] = web.RequestKey("served_version")
"""The policy version a generation's batch ran with."""

Frame = Callable[..., dict[str, Any]]
"""Wraps a stream's choices (and extra fields such as ``usage``) in its chunk envelope."""


# ---------------------------------------------------------------- server-sent events


def _sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _stream(request: web.Request, server: ModelServer, job: Job, *, name: str, frame: Frame,
                  choice: Callable[[Delta], dict[str, Any]], opening: Sequence[dict[str, Any]] = (),
                  answer: ResponsesAnswer | None = None) -> web.StreamResponse:
    """Stream a job as SSE: ``opening`` events, one event per choice per generated token, usage, then [DONE].

    The headers go out when the job's batch starts, once the policy version it runs with is
    noted. A failure before that is a plain error response; after it, vLLM's in-band error event.
    With ``answer`` (a ``/v1/responses`` call) the same chunks go out as the Responses API's events.
    """

    def event(payload: dict[str, Any]) -> bytes:
        return answer.chunk(payload) if answer is not None else _sse(payload)

    response: web.StreamResponse | None = None
    completion_tokens = 0
    try:
        async with aclosing(server.stream(job)) as steps:
            async for deltas in steps:
                if response is None:  # the batch started: its policy version is known
                    request[SERVED_VERSION] = job.version
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                    await response.prepare(request)
                    if answer is not None:
                        await response.write(answer.opening())
                    for opened in opening:
                        await response.write(event(opened))
                for delta in deltas:
                    completion_tokens += len(delta.token_ids)
                    await response.write(event(frame([choice(delta)])))
        if response is None:
            raise RuntimeError("the generation produced no tokens")
        if job.output.include_usage:
            await response.write(event(frame([], usage=server.usage(job, completion_tokens))))
    except Exception as error:
        if response is None:  # nothing sent yet: a plain error response
            raise
        if isinstance(error, ConnectionResetError):  # the client is gone
            return response
        log.exception("%s stream failed", name)  # headers are sent: report in-band, as vLLM does
        await response.write(answer.broken(str(error)) if answer is not None else
                             _sse(openai_error_body(str(error), "InternalServerError", 500)))
    await response.write(answer.closing() if answer is not None else _sse("[DONE]"))
    await response.write_eof()
    return response


# ---------------------------------------------------------------- chat completions


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _chat(request, await json_body(request))


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: the chat completion of the translated request, answered as a Response or its events."""
    body = await json_body(request)
    try:
        chat = chat_request(body)
    except ResponsesRequestError as error:
        return web.json_response(error.body(), status=400)
    return await _chat(request, chat, ResponsesAnswer(body))


async def _chat(request: web.Request, body: dict[str, Any], answer: ResponsesAnswer | None = None
                ) -> web.StreamResponse:
    server = request.app[SERVER]
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
    logprobs = bool_field(body, "logprobs", False)
    top_logprobs = int_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise RequestError("when using 'top_logprobs', 'logprobs' must be set to true", param="top_logprobs")
    try:
        prompt_ids = render_prompt(server.loaded.tokenizer, messages, tools, server.template_renders_tools)
    except PromptError as error:
        raise RequestError(str(error), param="messages") from None
    params = sampling_params(body, prompt_tokens=len(prompt_ids), context=server.context,
                             default_max_tokens=server.default_max_tokens,
                             logprobs=logprobs, top_logprobs=top_logprobs)
    job = Job(model_name=body.get("model") or server.name, adapter=adapter, prompt_ids=prompt_ids, params=params,
              output=output_options(body, logprobs))
    parse_tools = bool(tools) and tool_choice != "none"
    if job.output.stream:
        return await _stream_chat(request, server, job, parse_tools, answer)
    sequences = await server.complete(job)
    choices = [_chat_choice(server, job, sequence, parse_tools) for sequence in sequences]
    response = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": job.model_name, "choices": choices,
                "usage": server.usage(job, sum(len(s.token_ids) for s in sequences))}
    if job.output.return_token_ids:
        response["prompt_token_ids"] = job.prompt_ids
    request[SERVED_VERSION] = job.version
    return web.json_response(answer.whole(response) if answer is not None else response)


def _chat_choice(server: ModelServer, job: Job, sequence: SequenceState, parse_tools: bool) -> dict[str, Any]:
    """One choice of a non-streamed chat completion."""
    content: str | None = sequence.text
    tool_calls: list[dict[str, Any]] = []
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


async def _stream_chat(request: web.Request, server: ModelServer, job: Job, parse_tools: bool,
                       answer: ResponsesAnswer | None = None) -> web.StreamResponse:
    """SSE chat.completion.chunk events: each choice's role first, then one per choice per generated token."""
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                "model": job.model_name, "choices": choices, **extra}

    filters = [ToolStreamFilter() for _ in range(job.params.n)] if parse_tools else None
    opening = []
    for index in range(job.params.n):
        first = {"prompt_token_ids": job.prompt_ids} if job.output.return_token_ids and index == 0 else {}
        opening.append(chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}], **first))

    def choice(delta: Delta) -> dict[str, Any]:
        return _chat_stream_choice(server, job, delta, filters[delta.index] if filters else None)

    return await _stream(request, server, job, name="chat", frame=chunk, choice=choice, opening=opening,
                         answer=answer)


def _chat_stream_choice(server: ModelServer, job: Job, delta: Delta,
                        tool_filter: ToolStreamFilter | None) -> dict[str, Any]:
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
    body = await json_body(request)
    adapter = server.adapter(body.get("model"))
    if bool_field(body, "echo", False):
        raise RequestError("'echo' is not supported by the dev model server", param="echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        prompt_ids = list(server.loaded.tokenizer(
            prompt, add_special_tokens=bool_field(body, "add_special_tokens", True)).input_ids)
    else:
        prompt_ids = token_ids_field(prompt, "prompt", server.vocab_size)
    if not prompt_ids:
        raise RequestError("the prompt must not be empty", param="prompt")
    top_logprobs = int_field(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    params = sampling_params(body, prompt_tokens=len(prompt_ids), context=server.context,
                             default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
                             logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0)
    job = Job(model_name=body.get("model") or server.name, adapter=adapter, prompt_ids=prompt_ids, params=params,
              output=output_options(body, top_logprobs is not None))
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
    request[SERVED_VERSION] = job.version
    return web.json_response(response)


async def _stream_completion(request: web.Request, server: ModelServer, job: Job) -> web.StreamResponse:
    """SSE text_completion events, one per choice per generated token (the first of each with the prompt's ids)."""
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    offsets = [0] * job.params.n
    first = [True] * job.params.n

    def frame(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": completion_id, "object": "text_completion", "created": created,
                "model": job.model_name, "choices": choices, **extra}

    def choice(delta: Delta) -> dict[str, Any]:
        event = {"index": delta.index, "text": delta.text,
                 "logprobs": (server.completion_logprobs(delta.logprobs, offsets[delta.index])
                              if job.output.logprobs else None),
                 "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        offsets[delta.index] += sum(len(server.token_text(i)) for i in delta.token_ids)
        if job.output.return_token_ids:
            if first[delta.index]:
                event["prompt_token_ids"] = job.prompt_ids
            event["token_ids"] = delta.token_ids
        first[delta.index] = False
        return event

    return await _stream(request, server, job, name="completion", frame=frame, choice=choice)


# ---------------------------------------------------------------- models, adapters, weights, health


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the base model under each of its names, then the loaded LoRA adapters (with ``parent``),
    as vLLM lists them."""
    server = request.app[SERVER]

    def card(name: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": server.created, "owned_by": "agentstream", "root": root,
                "parent": parent, "max_model_len": max_model_len, "permission": []}

    bases = [card(name, server.loaded.source or server.name, None, server.context) for name in server.names]
    adapters = [card(name, adapter.path, server.name, None) for name, adapter in server.adapters.items()]
    return web.json_response({"object": "list", "data": [*bases, *adapters]})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path", "version"? (dev contract only), "load_inplace"?}."""
    server = request.app[SERVER]
    body = await json_body(request)
    if not body.get("lora_name") or not body.get("lora_path"):
        raise RequestError("Both 'lora_name' and 'lora_path' must be provided.", error_type="InvalidUserInput")
    name, path = str_field(body, "lora_name"), str_field(body, "lora_path")
    version = int_field(body, "version", 0, 0) if request.app[CONTRACT].versioned else 0
    if name in server.names:
        raise RequestError(f"'{name}' is the base model's name", error_type="InvalidUserInput", param="lora_name")
    if name in server.adapters and not bool_field(body, "load_inplace", False):
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
    body = await json_body(request)
    name = str_field(body, "lora_name")
    if server.adapters.pop(name, None) is None:
        raise RequestError(f"The lora adapter '{name}' cannot be found.", status=404)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def load_weights(request: web.Request) -> web.Response:
    """POST /v1/load_weights {"path", "version"}: swap the base weights once the running generation ends."""
    server = request.app[SERVER]
    body = await json_body(request)
    path = Path(str_field(body, "path"))
    version = int_field(body, "version", None, 0)
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

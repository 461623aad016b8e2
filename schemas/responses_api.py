"""The OpenAI Responses API as chat completions: a request translated down, the answer translated back up.

The proxy and the dev server serve ``POST /v1/responses`` by turning the request into the chat-completions
request a chat client would have sent (so the model server renders the same chat template, and the proxy
captures the exact token ids and logprobs of the chat contract), and turning the chat answer, whole or as
stream chunks, into a ``Response`` object or the Responses event stream the official SDK parses.

It is stateless: ``previous_response_id``, ``conversation``, background runs, stored prompts and built-in
tools are refused with a Responses-shaped 400 (:class:`ResponsesRequestError`) naming the parameter, never
answered wrongly. ``store``, ``include``, caching and service hints are accepted and have no effect.
Output items carry only the fields OpenAI's do: frameworks replay them verbatim in the next ``input``.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator, Mapping
from typing import Any

from agentstream.schemas.errors import AgentstreamError

HONOURED = frozenset({"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                      "top_p", "parallel_tool_calls", "stream", "text", "metadata", "top_logprobs"})
IGNORED = frozenset({"store", "include", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                     "prompt_cache_options", "service_tier", "stream_options", "reasoning", "truncation",
                     "background", "max_tool_calls"})
"""Accepted and without effect (``truncation`` only as ``disabled``, ``background`` only as false)."""
STATEFUL = ("previous_response_id", "conversation", "prompt", "context_management")
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ResponsesRequestError(AgentstreamError, ValueError):
    """A Responses request this server cannot answer as asked: HTTP 400 with OpenAI's error body."""

    def __init__(self, message: str, param: str | None, code: str = "unsupported_parameter") -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ------------------------------------------------------------------------------------------- the request


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions request that asks the same of the model as the Responses request ``body``."""
    _refuse_what_needs_state(body)
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    messages += chat_messages(body.get("input"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = [_chat_tool(tool, index) for index, tool in enumerate(body.get("tools") or [])]
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"], allowed = _chat_tool_choice(body["tool_choice"])
        if allowed is not None:
            chat["tools"] = [tool for tool in tools if tool["function"]["name"] in allowed]
    if tools and body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = bool(body["parallel_tool_calls"])
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    response_format = _response_format((body.get("text") or {}).get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _refuse_what_needs_state(body: Mapping[str, Any]) -> None:
    unknown = sorted(set(body) - HONOURED - IGNORED - set(STATEFUL))
    if unknown:
        raise ResponsesRequestError(f"Unknown parameter: '{unknown[0]}'.", unknown[0], "unknown_parameter")
    for name in STATEFUL:
        if body.get(name) is not None:
            raise ResponsesRequestError(
                f"Unsupported parameter: '{name}': this server keeps no state between responses; send the whole "
                "conversation as input items", name)
    if body.get("background"):
        raise ResponsesRequestError("Unsupported parameter: 'background': responses are answered in the request",
                                    "background")
    if body.get("truncation") not in (None, "disabled"):
        raise ResponsesRequestError("Unsupported value: 'truncation' can only be 'disabled' here", "truncation",
                                    "unsupported_value")


def chat_messages(items: Any) -> list[dict[str, Any]]:
    """Chat messages from a Responses ``input``: what a chat client would have sent for the same conversation.

    An assistant message and the function calls after it are one assistant message with ``tool_calls``
    (content None when it said nothing), a call's ``call_id`` is the tool call's id, and its output is a
    ``tool`` message.
    """
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ResponsesRequestError("'input' must be a string or a list of items", "input", "invalid_type")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise ResponsesRequestError(f"'{where}' must be an object", where, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ResponsesRequestError(f"'{where}.role' must be user, system, developer or assistant",
                                            f"{where}.role", "unsupported_value")
            content = _text(item.get("content"), f"{where}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last["content"] == "":
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning" and not item.get("encrypted_content"):
            continue  # the model's own summary of its reasoning: not part of what a chat client sends back
        else:
            raise ResponsesRequestError(f"input items of type '{kind}' are not supported here (messages, "
                                        "function_call and function_call_output are)", f"{where}.type",
                                        "unsupported_value")
    return messages


def _field(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ResponsesRequestError(f"'{where}.{name}' must be a string", f"{where}.{name}", "invalid_type")
    return value


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined (images and files are refused: the model reads text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesRequestError(f"'{where}' must be a string or a list of content parts", where, "invalid_type")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in TEXT_PARTS:
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise ResponsesRequestError(f"content parts of type '{kind}' are not supported here (the model reads "
                                        "text)", f"{where}[{index}].type", "unsupported_value")
    return "".join(texts)


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise ResponsesRequestError(f"tools of type '{kind}' are not supported here: only function tools, which "
                                    "the agent runs itself", f"{where}.type", "unsupported_value")
    function: dict[str, Any] = {"name": _field(tool, "name", where)}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> tuple[Any, set[str] | None]:
    """Chat's ``tool_choice`` for a Responses one, and the tool names it allows (None: all)."""
    if choice in ("auto", "none", "required"):
        return choice, None
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, None
    if isinstance(choice, Mapping) and choice.get("type") == "allowed_tools" and choice.get("mode") in ("auto",
                                                                                                     "required"):
        tools = [tool for tool in choice.get("tools") or [] if isinstance(tool, Mapping)]
        return choice["mode"], {str(tool.get("name")) for tool in tools}
    raise ResponsesRequestError("'tool_choice' must be auto, none, required, a function tool or allowed function "
                                "tools", "tool_choice", "unsupported_value")


def _response_format(format_: Any) -> dict[str, Any] | None:
    if format_ is None or (isinstance(format_, Mapping) and format_.get("type") == "text"):
        return None
    if isinstance(format_, Mapping) and format_.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(format_, Mapping) and format_.get("type") == "json_schema":
        schema = {key: format_[key] for key in ("name", "schema", "strict", "description") if key in format_}
        return {"type": "json_schema", "json_schema": schema}
    raise ResponsesRequestError("'text.format' must be text, json_object or json_schema", "text.format",
                                "unsupported_value")


# ------------------------------------------------------------------------------------------- the answer


def usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    input_tokens = int(chat_usage.get("prompt_tokens") or 0)
    output_tokens = int(chat_usage.get("completion_tokens") or 0)
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def envelope(request: Mapping[str, Any], response_id: str, created_at: int, status: str) -> dict[str, Any]:
    """The fields of a ``Response`` that echo the request (OpenAI sends each, null when unset)."""
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status, "error": None,
            "incomplete_details": None, "instructions": request.get("instructions"),
            "max_output_tokens": request.get("max_output_tokens"), "model": request.get("model"), "output": [],
            "parallel_tool_calls": request.get("parallel_tool_calls", True), "previous_response_id": None,
            "reasoning": request.get("reasoning") or {"effort": None, "summary": None}, "store": False,
            "temperature": request.get("temperature"), "text": request.get("text") or {"format": {"type": "text"}},
            "tool_choice": request.get("tool_choice", "auto"), "tools": list(request.get("tools") or []),
            "top_p": request.get("top_p"), "truncation": "disabled", "usage": None, "user": request.get("user"),
            "metadata": request.get("metadata") or {}}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def response_object(chat: Mapping[str, Any], request: Mapping[str, Any], response_id: str,
                    created_at: int) -> dict[str, Any]:
    """The ``Response`` for a whole chat completion of ``request`` (its first choice: Responses has no ``n``)."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    truncated = choice.get("finish_reason") == "length"
    response = envelope(request, response_id, created_at, "incomplete" if truncated else "completed")
    if truncated:
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    if message.get("content"):
        response["output"].append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        response["output"].append(call_item(new_id("fc"), call.get("id") or new_id("call"), function.get("name", ""),
                                            function.get("arguments") or ""))
    response["usage"] = usage(chat.get("usage"))
    return response


class ResponsesStream:
    """The Responses event stream for one streamed chat completion, fed its chunks in order.

    Events come in the order the official SDK checks: ``response.created`` and ``in_progress``; for the
    text, its item and content part added before any delta; each tool call its own ``function_call`` item,
    added with empty arguments before its argument deltas; every item done before ``response.completed``,
    which carries the whole output and the usage.
    """

    def __init__(self, request: Mapping[str, Any], response_id: str, created_at: int) -> None:
        self.request = request
        self.response_id = response_id
        self.created_at = created_at
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.text: dict[str, Any] | None = None  # the message being streamed: its item and text so far
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its function_call item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        response = envelope(self.request, self.response_id, self.created_at, "in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk makes (a usage-only chunk makes none)."""
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self.usage = usage(chunk["usage"])
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.text is None:
            item = message_item(new_id("msg"), "", "in_progress")
            item["content"] = []
            self.text = {"item": item, "index": len(self.output), "text": ""}
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=self.text["index"], item=item))
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self.text["index"], content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.text["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self.text["item"]["id"],
                                  output_index=self.text["index"], content_index=0, delta=text, logprobs=[]))
        return events

    def _call_delta(self, call: Mapping[str, Any]) -> list[dict[str, Any]]:
        events = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            item = call_item(new_id("fc"), call.get("id") or new_id("call"), function.get("name") or "", "",
                             "in_progress")
            item["output_index"] = len(self.output)
            self.calls[index] = item
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=item["output_index"],
                                      item=_public(item)))
        elif function.get("name"):
            item["name"] += function["name"]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=item["output_index"], delta=function["arguments"]))
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The closing events once the chat stream ended: every item done, then completed (or incomplete)."""
        events = []
        if self.text is not None:
            item, index, text = self.text["item"], self.text["index"], self.text["text"]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
            item.update(status="completed", content=[part])
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        for item in self.calls.values():
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=item["output_index"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=item["output_index"],
                                      item=_public(item)))
        truncated = self.finish_reason == "length"
        response = envelope(self.request, self.response_id, self.created_at, "incomplete" if truncated else
                            "completed")
        if truncated:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["output"] = [_public(item) for item in self.output]
        response["usage"] = self.usage
        events.append(self._event("response.incomplete" if truncated else "response.completed", response=response))
        return events

    def error(self, message: str, code: str = "server_error") -> dict[str, Any]:
        """The event that ends a stream the model server broke off (the SDK raises on it)."""
        return self._event("error", code=code, message=message, param=None)


def _public(item: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in item.items() if key != "output_index"}


def sse(event: Mapping[str, Any]) -> bytes:
    """One server-sent event as OpenAI writes it: the event name, then its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def sse_stream(events: Iterator[Mapping[str, Any]]) -> bytes:
    return b"".join(sse(event) for event in events)


class ResponsesAnswer:
    """What a Responses client reads of one chat call: the whole Response, or its stream's events as SSE bytes."""

    def __init__(self, request: Mapping[str, Any]) -> None:
        self.request = request
        self.response_id = new_id("resp")
        self.created_at = int(time.time())
        self.stream = ResponsesStream(request, self.response_id, self.created_at)
        self.closed = False

    def whole(self, chat: Mapping[str, Any]) -> dict[str, Any]:
        return response_object(chat, self.request, self.response_id, self.created_at)

    def opening(self) -> bytes:
        return sse_stream(iter(self.stream.start()))

    def chunk(self, chat_chunk: Mapping[str, Any]) -> bytes:
        return sse_stream(iter(self.stream.feed(chat_chunk)))

    def closing(self) -> bytes:
        """The events that end the stream, once (at the chat stream's ``[DONE]``, or when it ended without one)."""
        if self.closed:
            return b""
        self.closed = True
        return sse_stream(iter(self.stream.finish()))

    def broken(self, message: str) -> bytes:
        self.closed = True
        return sse_stream(iter([self.stream.error(message)]))

"""Tools in and out of text, hermes-style: tools rendered into chat prompts, ``<tool_call>`` blocks parsed out.

Rendering uses the tokenizer's chat template with ``tools=``. A template that ignores tools
(SmolLM2's does) gets them as a system-prompt description instead, with assistant tool calls
written as ``<tool_call>`` text and tool results as ``<tool_response>`` user turns, the format
the parser reads back.

The canonical form is what the description asks for and what a call is written back as: the
content verbatim, then each call as ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``
(``json.dumps`` defaults: ``", "`` and ``": "`` separators, non-ASCII kept, ``name`` first), calls
joined by one newline, nothing after the last. A completion in that form parses and re-renders into
the very text the model wrote, so the next turn's prompt extends the previous prompt and response
token for token (trajectory-level merging depends on it); any other form re-renders differently.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.json_body import NotJson, json_value

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
PROBE_TOOL: dict[str, Any] = {"type": "function", "function": {"name": "agentstream_probe_tool_7f3a", "parameters": {}}}


class PromptError(AgentstreamError):
    """The messages or tools cannot be rendered into a prompt."""


@dataclass(frozen=True)
class ParsedCompletion:
    """A completion split into assistant content (None when empty) and OpenAI-shaped tool calls."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def new_tool_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> ParsedCompletion:
    """Turn ``<tool_call>{"name", "arguments"}</tool_call>`` blocks into tool calls; the rest is content.

    A block whose body is not a JSON object with a string ``name`` stays in the content as text.
    An unterminated final block is parsed too (the model may stop right after the JSON). The text
    before the first call is kept verbatim, whitespace included (as vLLM's hermes parser does), so
    the call re-renders exactly; text between or after calls that is only whitespace separates
    them and is dropped. Content is None when nothing is left.
    """
    calls: list[dict[str, Any]] = []
    outside: list[str] = []
    position = 0
    for match in BLOCK.finditer(text):
        call = _tool_call(match.group(1) if match.group(1) is not None else match.group(2))
        outside.append(text[position:match.start()] if call else text[position:match.end()])
        position = match.end()
        if call:
            calls.append(call)
    outside.append(text[position:])
    if calls:  # whitespace pieces after the first call are separators, not content
        outside = [outside[0], *(piece for piece in outside[1:] if piece.strip())]
    content = "".join(outside)
    return ParsedCompletion(content=content or None, tool_calls=calls)


def _tool_call(body: str) -> dict[str, Any] | None:
    """One OpenAI tool call from a block body, or None if the body is not a valid call."""
    try:
        payload = json_value(body)
    except NotJson:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_tool_call_id(), "type": "function",
            "function": {"name": payload["name"], "arguments": arguments}}


class ToolStreamFilter:
    """Streams the content that precedes any tool call; everything from ``<tool_call>`` on waits for the end."""

    def __init__(self) -> None:
        self.seen = ""
        self.emitted = 0
        self.in_tool_call = False

    def feed(self, text: str) -> str:
        """Content from this delta that is safe to stream (never part of a possible ``<tool_call>``)."""
        self.seen += text
        if self.in_tool_call:
            return ""
        start = self.seen.find(TOOL_CALL_START)
        if start >= 0:
            self.in_tool_call = True
            safe = start
        else:
            safe = len(self.seen) - _partial_suffix(self.seen, TOOL_CALL_START)
        new = self.seen[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return new

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end of the sequence: the content not streamed yet and the parsed tool calls."""
        parsed = parse_tool_calls(self.seen)
        content = parsed.content or ""
        rest = content[self.emitted:] if content.startswith(self.seen[:self.emitted]) else ""
        return rest, parsed.tool_calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template puts the ``tools`` argument into the prompt."""
    messages = [{"role": "user", "content": "x"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[PROBE_TOOL], add_generation_prompt=True, tokenize=False)
    except Exception:  # a template that chokes on tools cannot render them
        return False
    return PROBE_TOOL["function"]["name"] in text


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  template_renders_tools: bool) -> list[int]:
    """Prompt token ids for a chat request, tools included (natively or as a system-prompt description)."""
    messages = [normalize_message(message) for message in messages]
    if tools and not template_renders_tools:
        messages, tools = describe_tools_in_system_prompt(messages, tools), None
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    except Exception as error:  # jinja errors: the template rejects these messages
        raise PromptError(f"the chat template cannot render these messages: {error}") from None
    return list(ids)


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message with string content (text parts joined) and tool-call arguments as objects, as templates expect."""
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise PromptError("only text content parts are supported")
            texts.append(part["text"])
        message["content"] = "".join(texts)
    if message.get("tool_calls"):
        message["tool_calls"] = [_call_with_object_arguments(call) for call in message["tool_calls"]]
    return message


def _call_with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call whose JSON-string arguments are parsed into an object (left as text if not JSON)."""
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json_value(function["arguments"])
        except NotJson:
            pass
    return {**call, "function": function}


def describe_tools_in_system_prompt(messages: list[dict[str, Any]],
                                    tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system prompt, calls and results as text."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    description = (
        "# Tools\n\nYou may call one or more functions to help with the user's request. "
        f"The available functions are listed in <tools></tools>:\n<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and arguments inside "
        '<tool_call></tool_call> tags:\n<tool_call>\n{"name": "<function name>", "arguments": {...}}\n</tool_call>'
    )
    rendered = [_as_text_message(message) for message in messages]
    if rendered and rendered[0]["role"] == "system":
        return [{"role": "system", "content": f"{rendered[0]['content']}\n\n{description}"}, *rendered[1:]]
    return [{"role": "system", "content": description}, *rendered]


def assistant_text(message: dict[str, Any]) -> str:
    """What an assistant turn is written back as in later prompts of a template without tool support.

    Its content, then each tool call as a ``<tool_call>`` block: the form a model that writes its
    calls this way gets back token for token, and the form demonstrations are written in.
    """
    return _as_text_message(normalize_message(message))["content"]


def _as_text_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message with tool calls or a tool result rewritten as hermes-style text, calls in the canonical form."""
    content = message.get("content") or ""
    if message.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = "\n".join(canonical_tool_call(call["function"]["name"], call["function"].get("arguments", {}))
                      for call in message.get("tool_calls") or [])
    return {"role": message["role"], "content": content + calls}


def canonical_tool_call(name: str, arguments: Any) -> str:
    """One tool call in the canonical form: the text a model should write and the text written back."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"

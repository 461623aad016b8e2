"""Tool calls in text: parsing, the stream filter that never leaks a call, rendering, and the canonical form."""

from __future__ import annotations

import json

import pytest

from agentstream.models import tiny_tokenizer
from agentstream.serving.tool_format import (
    ToolStreamFilter,
    canonical_tool_call,
    parse_tool_calls,
    render_prompt,
    renders_tools,
)
from tests.support.servers import HELLO, WEATHER_TOOL


def test_parse_tool_calls_from_text():
    parsed = parse_tool_calls('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                              '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert parsed.content == "Let me look.\n"
    assert [call["function"]["name"] for call in parsed.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in parsed.tool_calls)

    unterminated = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert unterminated.content is None and unterminated.tool_calls[0]["function"]["arguments"] == '{"x": 1}'
    broken = parse_tool_calls("<tool_call>{not json}</tool_call>")
    assert broken.tool_calls == [] and broken.content == "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls("no tools here") == parse_tool_calls("no tools here")
    assert parse_tool_calls("no tools here").tool_calls == []
    spaced = parse_tool_calls('\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", '
                              '"arguments": {}}</tool_call>\n')
    assert spaced.content == "\n" and len(spaced.tool_calls) == 2, "leading text is kept, separators are not"


def test_tool_stream_filter_never_leaks_a_tool_call():
    text = 'Sure.<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    stream_filter = ToolStreamFilter()
    streamed = "".join(stream_filter.feed(character) for character in text)
    rest, calls = stream_filter.finish()
    assert streamed + rest == "Sure." and calls[0]["function"]["name"] == "f"
    partial = ToolStreamFilter()
    assert partial.feed("ok <tool") == "ok "
    assert partial.feed("kit") == "<toolkit"


def test_tools_render_natively_or_as_a_system_prompt():
    tokenizer = tiny_tokenizer()
    conversation = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert renders_tools(tokenizer)
    native = tokenizer.decode(render_prompt(tokenizer, conversation, [WEATHER_TOOL], True))
    assert '"name": "get_weather"' in native and "<tools>" in native
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in native
    assert "<tool_response>\nsunny\n</tool_response>" in native

    plain = tiny_tokenizer()  # a template that ignores tools, like SmolLM2's
    plain.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert not renders_tools(plain)
    fallback = plain.decode(render_prompt(plain, conversation, [WEATHER_TOOL], False))
    assert fallback.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in fallback
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in fallback
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in fallback


PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # ignores tools, like SmolLM2's


CALL = canonical_tool_call("get_weather", {"city": "Oslo"})


@pytest.mark.parametrize(("written", "extends"), [
    (CALL, True),
    ("Let me look.\n" + CALL, True),
    ("Sure. " + CALL + "\n" + canonical_tool_call("get_time", {"zone": "CET", "exact": True}), True),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', False),
    ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>', False),
    ('<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>', False),
    (CALL + "\nDone.", False),
], ids=["canonical", "text-before", "two-calls", "no-newlines", "compact", "keys-swapped", "text-after"])
def test_a_tool_call_sent_back_re_renders_into_the_tokens_written_in_the_canonical_form_only(written, extends):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = PLAIN_TEMPLATE
    prompt = render_prompt(tokenizer, HELLO, [WEATHER_TOOL], False)
    response = tokenizer.encode(written + "<|im_end|>", add_special_tokens=False)  # bytes: the turn's end is text
    parsed = parse_tool_calls(written)
    assert parsed.tool_calls, "every form parses into a call"
    sent_back = json.loads(json.dumps({"role": "assistant", "content": parsed.content,
                                       "tool_calls": parsed.tool_calls}))  # as the SDK sends it
    results = [{"role": "tool", "tool_call_id": call["id"], "content": "ok"} for call in parsed.tool_calls]
    following = render_prompt(tokenizer, [*HELLO, sent_back, *results], [WEATHER_TOOL], False)
    sequence = prompt + response
    assert (following[:len(sequence)] == sequence) is extends

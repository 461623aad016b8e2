"""The Responses API as chat completions: requests translate down, answers translate up into what the SDK parses.

Answers are read back with the official ``openai`` SDK's own models, strictly validated, and streams are
replayed through the SDK's stream accumulator (``ResponseStreamState``), which raises on an event out of order.
"""

from __future__ import annotations

import json

import pytest
from openai import NOT_GIVEN
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agentstream.schemas.responses_api import (
    ResponsesRequestError,
    ResponsesStream,
    chat_request,
    response_object,
    sse,
)

pytestmark = pytest.mark.unit

EVENTS: TypeAdapter = TypeAdapter(ResponseStreamEvent)
ADD = {"type": "function", "name": "add", "description": "a+b", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    chat = chat_request({"model": "m", "instructions": "Be terse.", "input": "2+2?", "max_output_tokens": 9,
                         "temperature": 0.5, "store": True, "include": []})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "Be terse."},
                                               {"role": "user", "content": "2+2?"}],
                    "max_tokens": 9, "temperature": 0.5}


def test_a_tool_loop_replayed_as_items_is_the_conversation_a_chat_client_sends():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Compute "}, {"type": "input_text",
                                                                                      "text": "2+3"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add",
              "arguments": '{"a":2,"b":3}', "status": "completed"},
             {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a":0,"b":0}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "5"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "0"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "call_3", "name": "add", "arguments": "{}"}]
    chat = chat_request({"model": "m", "input": items, "tools": [ADD], "tool_choice": {"type": "function",
                                                                                       "name": "add"},
                         "parallel_tool_calls": False})
    assert chat["messages"] == [
        {"role": "user", "content": "Compute 2+3"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a":0,"b":0}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "tool", "tool_call_id": "call_2", "content": "0"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "add", "description": "a+b",
                                                               "parameters": ADD["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["parallel_tool_calls"] is False


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"background": True}, "background", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_value"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type", "unsupported_value"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "unsupported_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "unsupported_value"),
    ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "unsupported_value"),
])
def test_what_needs_state_or_builtin_tools_is_refused_naming_the_parameter(body, param, code):
    with pytest.raises(ResponsesRequestError) as refused:
        chat_request({"model": "m", "input": "hi", **body})
    assert refused.value.param == param
    assert refused.value.body()["error"] == {"message": str(refused.value), "type": "invalid_request_error",
                                             "param": param, "code": code}


def test_a_whole_answer_is_a_response_the_sdk_validates():
    chat = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7}}
    request = {"model": "m", "input": "1+2", "tools": [ADD], "metadata": {"k": "v"}}
    response = Response.model_validate(response_object(chat, request, "resp_1", 1767000000), strict=False)
    assert response.status == "completed" and response.output_text == "Adding."
    [message, call] = response.output
    assert message.type == "message" and call.type == "function_call"
    assert (call.call_id, call.name, json.loads(call.arguments)) == ("call_9", "add", {"a": 1, "b": 2})
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens,
                                           response.usage.total_tokens) == (12, 7, 19)
    assert response.metadata == {"k": "v"} and response.tools[0].name == "add"


def test_an_answer_cut_at_max_output_tokens_is_incomplete():
    chat = {"choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "12"}}]}
    response = Response.model_validate(response_object(chat, {"model": "m"}, "resp_2", 1))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def chat_chunks(text: list[str], calls: list[tuple[str, str, list[str]]], finish: str) -> list[dict]:
    """Chat stream chunks as vLLM sends them: text deltas, then each call's id and name, then its arguments."""
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in text]
    for index, (call_id, name, pieces) in enumerate(calls):
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]}}]})
        chunks += [{"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": index, "function": {"arguments": piece}}]}}]} for piece in pieces]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
    return chunks


def replay(chunks: list[dict], request: dict) -> tuple[list[dict], Response]:
    """The events a stream makes, each parsed by the SDK and fed to its accumulator; the final response."""
    stream = ResponsesStream(request, "resp_3", 1767000000)
    events = stream.start() + [event for chunk in chunks for event in stream.feed(chunk)] + stream.finish()
    state = ResponseStreamState(input_tools=request.get("tools", NOT_GIVEN), text_format=NOT_GIVEN)
    for event in events:
        wire = sse(event).decode()
        assert wire.startswith(f"event: {event['type']}\ndata: ") and wire.endswith("\n\n")
        state.handle_event(EVENTS.validate_python(json.loads(wire.split("data: ", 1)[1])))
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events, Response.model_validate(events[-1]["response"])


def test_a_streamed_text_answer_is_the_event_sequence_the_sdk_accumulates():
    events, final = replay(chat_chunks(["The answer", " is 4."], [], "stop"), {"model": "m", "input": "2+2"})
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert final.output_text == "The answer is 4." and final.usage.total_tokens == 9


def test_a_streamed_tool_call_is_its_own_item_with_arguments_from_the_deltas():
    request = {"model": "m", "input": "2+3", "tools": [ADD]}
    events, final = replay(chat_chunks(["Adding."], [("call_1", "add", ['{"a":', '2,"b":3}']),
                                                     ("call_2", "add", ["{}"])], "tool_calls"), request)
    added = [event["item"] for event in events if event["type"] == "response.output_item.added"]
    assert [item["type"] for item in added] == ["message", "function_call", "function_call"]
    assert all(item.get("arguments", "") == "" for item in added)  # the SDK appends the deltas to these
    [message, first, second] = final.output
    assert message.type == "message"
    assert (first.call_id, first.arguments, second.call_id, second.arguments) == ("call_1", '{"a":2,"b":3}',
                                                                                 "call_2", "{}")
    deltas = [event for event in events if event["type"] == "response.function_call_arguments.delta"]
    assert {event["item_id"] for event in deltas} == {first.id, second.id}
    assert "output_index" not in first.model_dump(exclude_unset=True)


def test_a_stream_cut_at_max_output_tokens_ends_incomplete():
    events, final = replay(chat_chunks(["12"], [], "length"), {"model": "m", "input": "count"})
    assert events[-1]["type"] == "response.incomplete" and final.status == "incomplete"

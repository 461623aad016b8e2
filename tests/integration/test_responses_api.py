"""The Responses API through the proxy and on the dev server, driven by the official openai SDK:
``client.responses.create``, plain and streamed, ``responses.stream``, a tool loop of function_call /
function_call_output items, and refused parameters, with the spans read back from Kafka carrying the ids the dev
server generated."""

from __future__ import annotations

import json

import openai
import pytest

from agentstream.models import load_model
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.serving.app import create_app
from agentstream.serving.protocol import Contract
from tests.integration.test_proxy import spans_of
from tests.support.http_thread import ServerThread
from tests.support.servers import assert_exact, scripted

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}
CALL = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture
def proxy(tiny, publisher: SpanPublisher):
    upstream = ServerThread(create_app(tiny))
    running = ServerThread(LLMProxy(upstream.url, publisher).app)
    yield running
    running.stop()
    upstream.stop()


def client_for(url: str, rollout: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/rollouts/{rollout}/v1", api_key="unused", max_retries=0)


def test_a_response_and_its_span_carry_what_the_server_generated(proxy, tiny, publisher, topics_config,
                                                                 kafka_options):
    response = client_for(proxy.url, "r-resp").responses.create(
        model="tiny", instructions="Answer briefly.", input="Say hello.", max_output_tokens=12, temperature=0.7,
        store=True, include=[])
    assert response.object == "response" and response.id.startswith("resp_")
    # Random tiny weights sometimes sample only tokens that decode to nothing (4 of 150 tries): then the Response
    # has no message item and an empty output_text, which assert_exact still holds to what the ids decode to.
    assert response.status in ("completed", "incomplete")
    assert response.usage.output_tokens > 0
    (span,) = spans_of(publisher, topics_config, kafka_options, "r-resp", 1)
    assert span["kind"] == "LLM" and span["status"] == "OK"
    assert len(span["response_token_ids"]) == response.usage.output_tokens
    messages = json.loads(span["attributes"]["gen_ai.input.messages"])
    assert [message["role"] for message in messages] == ["system", "user"]
    assert_exact(tiny, tiny.model, span["prompt_token_ids"], span["response_token_ids"], response.output_text,
                 span["response_logprobs"], 0.7)


def test_a_streamed_response_is_what_the_sdk_accumulates(proxy, tiny, publisher, topics_config, kafka_options):
    client = client_for(proxy.url, "r-resp-stream")
    kinds, text = [], ""
    for event in client.responses.create(model="tiny", input="Say hello.", max_output_tokens=16, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    (span,) = spans_of(publisher, topics_config, kafka_options, "r-resp-stream", 1)
    assert span["attributes"]["gen_ai.request.stream"] == "true"
    assert_exact(tiny, tiny.model, span["prompt_token_ids"], span["response_token_ids"], text,
                 span["response_logprobs"], 1.0)


def test_the_sdk_stream_helper_gets_its_final_response(publisher, topics_config, kafka_options):
    """``client.responses.stream`` checks every event's order and identity, and wants ``response.completed``."""
    loaded = scripted("Hello there, friend.")
    upstream = ServerThread(create_app(loaded))
    proxy = ServerThread(LLMProxy(upstream.url, publisher).app)
    try:
        with client_for(proxy.url, "r-resp-helper").responses.stream(model="scripted", input="Say hello.") as stream:
            final = stream.get_final_response()
        assert final.status == "completed" and final.output_text == "Hello there, friend."
        (span,) = spans_of(publisher, topics_config, kafka_options, "r-resp-helper", 1)
        assert loaded.tokenizer.decode(span["response_token_ids"], skip_special_tokens=True) == final.output_text
        assert final.usage.output_tokens == len(span["response_token_ids"])
    finally:
        proxy.stop()
        upstream.stop()


def test_a_tool_loop_of_items_works_plain_and_streamed(publisher, topics_config, kafka_options):
    loaded = scripted(CALL)
    upstream = ServerThread(create_app(loaded))
    proxy = ServerThread(LLMProxy(upstream.url, publisher).app)
    try:
        client = client_for(proxy.url, "r-resp-tool")
        first = client.responses.create(model="scripted", input="Weather in Paris?", tools=[WEATHER])
        [message, call] = first.output
        assert message.type == "message" and call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        replay = [{"role": "user", "content": "Weather in Paris?"}, *[item.model_dump(exclude_unset=True)
                                                                      for item in first.output],
                  {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        with client.responses.stream(model="scripted", input=replay, tools=[WEATHER]) as stream:
            second = stream.get_final_response()
        assert [item.type for item in second.output] == ["message", "function_call"]
        spans = sorted(spans_of(publisher, topics_config, kafka_options, "r-resp-tool", 2),
                       key=lambda span: span["start_time_us"])
        sent = json.loads(spans[1]["attributes"]["gen_ai.input.messages"])
        assert [message["role"] for message in sent] == ["user", "assistant", "tool"]
        assert sent[1]["tool_calls"][0]["id"] == call.call_id and sent[2]["tool_call_id"] == call.call_id
        for span in spans:
            assert loaded.tokenizer.decode(span["response_token_ids"], skip_special_tokens=True) == CALL
            assert json.loads(span["attributes"]["gen_ai.response.finish_reasons"]) == ["tool_calls"]
    finally:
        proxy.stop()
        upstream.stop()


def test_what_needs_state_gets_a_responses_shaped_400(proxy):
    client = client_for(proxy.url, "r-resp-refused")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_123")
    assert refused.value.status_code == 400
    assert (refused.value.param, refused.value.code) == ("previous_response_id", "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="hi", tools=[{"type": "web_search_preview"}])
    assert refused.value.param == "tools[0].type"


@pytest.mark.parametrize("contract", [Contract.DEV, Contract.VLLM])
def test_the_dev_server_serves_the_responses_api_itself(contract):
    """Without the proxy: the same translation around the server's own chat handler, in both contracts."""
    loaded = scripted(CALL)
    server = ServerThread(create_app(loaded, contract=contract))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        response = client.responses.create(model="scripted", input="Weather in Paris?", tools=[WEATHER])
        assert [item.type for item in response.output] == ["message", "function_call"]
        assert json.loads(response.output[1].arguments) == {"city": "Paris"}
        with client.responses.stream(model="scripted", input="Weather in Paris?", tools=[WEATHER]) as stream:
            streamed = stream.get_final_response()
        assert streamed.output[1].name == "get_weather" and streamed.usage.output_tokens > 0
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="scripted", input="hi", conversation="conv_1")
        assert refused.value.param == "conversation"
    finally:
        server.stop()

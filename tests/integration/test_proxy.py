"""The LLM proxy driven by the official openai SDK, in front of the dev model server, spans read back from Kafka."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from agentstream.infra.kafka import topic_name
from agentstream.infra.security import FEEDBACK_TOKEN_HEADER, feedback_token
from agentstream.models import load_model
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.serving.app import create_app
from tests.support.http_thread import ServerThread
from tests.support.readback import read_topic
from tests.support.servers import assert_exact, scripted

HELLO = [{"role": "user", "content": "Say hello."}]
SECRET = b"feedback secret"  # tokens on, as `agentstream proxy` runs by default
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def upstream(tiny):
    running = ServerThread(create_app(tiny))
    yield running
    running.stop()


@pytest.fixture
def proxy(upstream, publisher: SpanPublisher):
    running = ServerThread(LLMProxy(upstream.url, publisher, feedback_secret=SECRET).app)
    yield running
    running.stop()


def spans_of(publisher: SpanPublisher, config, kafka_options, rollout_id: str, count: int) -> list[dict]:
    publisher.flush(10)
    landed = read_topic(kafka_options, topic_name(config.topics, "spans"),
                        lambda got: len(got.of(rollout_id)[0]) >= count, timeout_s=20)
    spans = landed.of(rollout_id)[0]
    assert len(spans) == count, f"expected {count} spans for {rollout_id}, got {len(spans)}"
    return sorted(spans, key=lambda s: int(s["attributes"].get("agentstream.choice.index", "0")))


def test_spans_carry_the_exact_ids_and_logprobs_the_server_generated(proxy, tiny, publisher, topics_config,
                                                                     kafka_options):
    client = openai.OpenAI(base_url=f"{proxy.url}/rollouts/r-exact/v1", api_key="unused", max_retries=0)
    asked = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0.7, seed=3,
                                           logprobs=True, extra_body={"return_token_ids": True})
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=1.0, seed=4)
    assert "token_ids" not in (plain.choices[0].model_extra or {}) and plain.choices[0].logprobs is None, \
        "fields the client did not ask for are stripped"
    assert "prompt_token_ids" not in (plain.model_extra or {})
    first, second = sorted(spans_of(publisher, topics_config, kafka_options, "r-exact", 2),
                           key=lambda s: s["start_time_us"])
    choice = asked.choices[0]
    assert first["response_token_ids"] == choice.model_extra["token_ids"]
    assert first["prompt_token_ids"] == asked.model_extra["prompt_token_ids"]
    assert first["response_logprobs"] == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-6)
    for span, response, temperature in ((first, asked, 0.7), (second, plain, 1.0)):
        assert span["kind"] == "LLM" and span["status"] == "OK" and span["policy_version"] == 0
        assert span["attributes"]["gen_ai.request.model"] == "tiny"
        assert int(span["attributes"]["gen_ai.usage.output_tokens"]) == len(span["response_token_ids"])
        assert_exact(tiny, tiny.model, span["prompt_token_ids"], span["response_token_ids"],
                     response.choices[0].message.content, span["response_logprobs"], temperature)


def test_streaming_is_relayed_and_captured(proxy, tiny, publisher, topics_config, kafka_options):
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0,
                           default_headers={"X-Agentstream-Rollout": "r-stream"})
    text, chunks = "", 0
    for chunk in client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16, stream=True, seed=5):
        chunks += 1
        assert chunk.usage is None, "usage is only sent when the client asks for it"
        for choice in chunk.choices:
            assert "token_ids" not in (choice.model_extra or {})
            text += choice.delta.content or ""
    assert chunks > 2
    (span,) = spans_of(publisher, topics_config, kafka_options, "r-stream", 1)
    assert span["attributes"]["gen_ai.request.stream"] == "true"
    assert_exact(tiny, tiny.model, span["prompt_token_ids"], span["response_token_ids"], text,
                 span["response_logprobs"], 1.0)


def test_n_samples_become_one_span_each_with_async_client(proxy, tiny, publisher, topics_config, kafka_options):
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{proxy.url}/rollouts/r-n/v1", api_key="unused", max_retries=0)
        return await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, n=3, seed=9)

    response = asyncio.run(go())
    spans = spans_of(publisher, topics_config, kafka_options, "r-n", 3)
    for span, choice in zip(spans, sorted(response.choices, key=lambda c: c.index), strict=True):
        assert span["attributes"]["agentstream.choice.index"] == str(choice.index)
        assert_exact(tiny, tiny.model, span["prompt_token_ids"], span["response_token_ids"], choice.message.content,
                     span["response_logprobs"], 1.0)
    assert len({tuple(s["response_token_ids"]) for s in spans}) > 1
    # Token counts sum without double counting: each choice its own completion, the prompt once per call.
    outputs = [int(span["attributes"]["gen_ai.usage.output_tokens"]) for span in spans]
    assert outputs == [len(span["response_token_ids"]) for span in spans]
    assert sum(outputs) == response.usage.completion_tokens
    inputs = [span["attributes"].get("gen_ai.usage.input_tokens") for span in spans]
    assert [int(value) for value in inputs if value is not None] == [response.usage.prompt_tokens]
    assert inputs[0] is not None, "the first choice's span carries the call's prompt tokens"


def test_completions_and_models_pass_through(proxy, tiny, publisher, topics_config, kafka_options):
    client = openai.OpenAI(base_url=f"{proxy.url}/rollouts/r-comp/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt="abc", max_tokens=6, seed=1)
    (span,) = spans_of(publisher, topics_config, kafka_options, "r-comp", 1)
    assert span["attributes"]["gen_ai.operation.name"] == "text_completion"
    assert_exact(tiny, tiny.model, span["prompt_token_ids"], span["response_token_ids"], completion.choices[0].text,
                 span["response_logprobs"], 1.0)


def test_tool_calls_are_relayed_and_captured(publisher, topics_config, kafka_options):
    raw = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    loaded = scripted(raw)
    upstream = ServerThread(create_app(loaded))
    proxy = ServerThread(LLMProxy(upstream.url, publisher).app)
    try:
        client = openai.OpenAI(base_url=f"{proxy.url}/rollouts/r-tool/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(model="scripted", messages=HELLO, tools=[WEATHER_TOOL],
                                                  max_tokens=200)
        (call,) = response.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        streamed = {}
        for chunk in client.chat.completions.create(model="scripted", messages=HELLO, tools=[WEATHER_TOOL],
                                                    max_tokens=200, stream=True):
            for choice in chunk.choices:
                for tool_call in choice.delta.tool_calls or []:
                    streamed[tool_call.index] = tool_call
        assert streamed[0].function.name == "get_weather"
        spans = spans_of(publisher, topics_config, kafka_options, "r-tool", 2)
        for span in spans:
            output = json.loads(span["attributes"]["gen_ai.output.messages"])[0]
            assert output["tool_calls"][0]["function"]["name"] == "get_weather"
            assert json.loads(output["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
            assert loaded.tokenizer.decode(span["response_token_ids"], skip_special_tokens=True) == raw
            assert "get_weather" in span["attributes"]["gen_ai.tool.definitions"]
            assert json.loads(span["attributes"]["gen_ai.response.finish_reasons"]) == ["tool_calls"]
    finally:
        proxy.stop()
        upstream.stop()


def test_upstream_down_gives_an_openai_error_and_an_error_span(publisher, topics_config, kafka_options):
    from agentstream.infra.processes import free_port

    proxy = ServerThread(LLMProxy(f"http://127.0.0.1:{free_port()}", publisher).app)
    try:
        client = openai.OpenAI(base_url=f"{proxy.url}/rollouts/r-down/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="tiny", messages=HELLO)
        assert raised.value.status_code == 502
        assert "model server" in raised.value.body["message"]
        (span,) = spans_of(publisher, topics_config, kafka_options, "r-down", 1)
        assert span["status"] == "ERROR" and "unreachable" in span["status_message"]
        with urllib.request.urlopen(proxy.url + "/health") as health:
            assert health.status == 200, "the proxy keeps serving"
    finally:
        proxy.stop()


def test_late_rewards_and_unattributed_calls(proxy, publisher, topics_config, kafka_options):
    token = {FEEDBACK_TOKEN_HEADER: feedback_token(SECRET, "r-late")}  # what a trusted backend mints
    request = urllib.request.Request(f"{proxy.url}/rollouts/r-late/reward", method="POST",
                                     data=json.dumps({"dimensions": {"thumbs_up": 1.0, "latency": -0.25}}).encode(),
                                     headers={"Content-Type": "application/json", **token})
    with urllib.request.urlopen(request) as response:
        assert response.status == 202 and json.loads(response.read())["reward"] == 0.75
    (reward,) = spans_of(publisher, topics_config, kafka_options, "r-late", 1)
    assert reward["kind"] == "REWARD" and reward["reward"] == 0.75
    assert reward["reward_dimensions"] == {"thumbs_up": 1.0, "latency": -0.25}

    bad = urllib.request.Request(f"{proxy.url}/rollouts/r-late/reward", method="POST", data=b"{\"reward\": \"x\"}",
                                 headers=token)
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(bad)
    assert raised.value.code == 400

    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=HELLO, max_tokens=4)
    response = raw.parse()
    publisher.flush(10)
    landed = read_topic(kafka_options, topic_name(topics_config.topics, "spans"),
                        lambda got: any(s["rollout_id"].startswith("unattributed-") for s in got.spans))
    unattributed = [s for s in landed.spans if s["rollout_id"].startswith("unattributed-")]
    assert len(unattributed) == 1
    assert unattributed[0]["attributes"]["gen_ai.response.id"] == response.id
    assert raw.headers[FEEDBACK_TOKEN_HEADER] == feedback_token(SECRET, unattributed[0]["rollout_id"]), \
        "an unattributed call is a rollout of its own, and its feedback token says which"


def test_the_rollout_base_url_attributes_calls_to_rollout_attempt_and_agent(proxy, publisher, topics_config,
                                                                            kafka_options):
    from agentstream.pipeline.sdk import Rollout

    owner = Rollout("r-agent", "r-agent-2", "math agent/v2", proxy_url=proxy.url)
    assert owner.llm_base_url() == f"{proxy.url}/rollouts/r-agent/attempts/r-agent-2/agents/math%20agent%2Fv2/v1"
    client = openai.OpenAI(base_url=owner.llm_base_url(), api_key="unused", max_retries=0)
    client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)
    anonymous = Rollout("r-anon", "r-anon-1", None, proxy_url=proxy.url)
    assert anonymous.llm_base_url() == f"{proxy.url}/rollouts/r-anon/attempts/r-anon-1/v1"
    (span,) = spans_of(publisher, topics_config, kafka_options, "r-agent", 1)
    assert (span["attempt_id"], span["agent_name"]) == ("r-agent-2", "math agent/v2")

"""Agent Lightning's URLs at the proxy, its 1.0 event API, model "auto", default max_tokens, and a 1.0 agent process."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from agentstream.infra.config import AglConfig
from agentstream.models import load_model
from agentstream.pipeline import sdk
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.runner.agl import run_subprocess_agent
from agentstream.serving.app import create_app
from tests.integration.test_proxy import spans_of
from tests.support.http_thread import ServerThread

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def upstream():
    running = ServerThread(create_app(load_model("tiny"), max_tokens=7))
    yield running
    running.stop()


@pytest.fixture
def proxy(upstream, publisher: SpanPublisher):
    running = ServerThread(LLMProxy(upstream.url, publisher, max_tokens=5).app)
    yield running
    running.stop()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_agent_lightning_url_shapes_are_aliases_and_events_are_rewards(proxy, publisher, topics_config,
                                                                       kafka_options):
    for base in (f"{proxy.url}/rollout/agl-r1/attempt/agl-r1-a1/v1",
                 f"{proxy.url}/proxy/rollout/agl-r1/attempt/agl-r1-a1/mode/train/openai/v1"):
        client = openai.OpenAI(base_url=base, api_key="k", max_retries=0)
        reply = client.chat.completions.create(model="auto", messages=HELLO)  # no max_tokens: the proxy's 5
        assert reply.model == "tiny" and reply.usage.completion_tokens <= 5
    answer = post(f"{proxy.url}/api/rollouts/agl-r1/attempt/agl-r1-a1/events",
                  {"event_type": "reward", "data": {"value": 0.5}})
    assert answer["event_type"] == "reward" and answer["attempt_id"] == "agl-r1-a1"
    post(f"{proxy.url}/api/rollouts/agl-r1/attempt/agl-r1-a1/events", {"event_type": "tool", "data": {"n": 1}})
    spans = spans_of(publisher, topics_config, kafka_options, "agl-r1", 4)
    assert {s["attempt_id"] for s in spans} == {"agl-r1-a1"}
    llm = [s for s in spans if s["kind"] == "LLM"]
    assert len(llm) == 2 and all(s["response_token_ids"] and s["model"] == "tiny" for s in llm)
    assert all(s["attributes"]["gen_ai.request.max_tokens"] == "5" for s in llm)
    assert [s["reward"] for s in spans if s["kind"] == "REWARD"] == [0.5]
    assert [s["name"] for s in spans if s["kind"] == "OBJECT"] == ["tool"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(f"{proxy.url}/api/rollouts/agl-r1/attempt/agl-r1-a1/events", {"event_type": "reward", "data": {}})
    assert refused.value.code == 400


def test_the_model_server_bounds_a_chat_without_max_tokens(upstream):
    client = openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="k", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=HELLO)
    assert reply.usage.completion_tokens <= 7


def test_an_agent_lightning_1_0_agent_runs_in_its_own_process(proxy, publisher, topics_config, kafka_options):
    agent = run_subprocess_agent("tests.support.agl_agents:EnvAgent", AglConfig())

    async def once() -> None:
        with sdk.rollout("env-agent", rollout_id="agl-env", attempt_id="agl-env-a1", sink=publisher,
                         proxy_url=proxy.url) as state:
            await agent({"prompt": "Write letters."}, state)

    asyncio.run(once())
    spans = spans_of(publisher, topics_config, kafka_options, "agl-env", 3)  # LLM, reward, the root span
    kinds = sorted(s["kind"] for s in spans)
    assert kinds == ["AGENT", "LLM", "REWARD"]
    llm = next(s for s in spans if s["kind"] == "LLM")
    assert llm["agent_name"] == "env-agent" and llm["attempt_id"] == "agl-env-a1" and llm["response_token_ids"]

    failing = run_subprocess_agent("tests.support.agl_agents:NoSuchAgent", AglConfig())
    with pytest.raises(RuntimeError, match="exited with code 1"):
        asyncio.run(failing({}, sdk.Rollout("x", "x-1", proxy_url=proxy.url)))

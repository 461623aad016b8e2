"""With ``[security] proxy_keys`` set, the stack's own clients of the proxy present the configured key.

The runner's rollouts of ``agentstream.examples.arithmetic``, the gate's evaluation and Agent Lightning 0.3 and
1.0 agents run through a keyed proxy to the real dev model server: with the configured key their
LLM spans land with token ids; with a wrong key, or none, the proxy refuses them (401) and the
rollouts record the refusal.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import openai
import pytest

from agentstream.deploy.gate import GATE_AGENT, EvaluationError
from agentstream.evaluation import EVAL_ATTEMPTS, task_evaluator
from agentstream.examples import arithmetic
from agentstream.infra.config import AglConfig, Config, Secret
from agentstream.infra.kafka import topic_name
from agentstream.infra.security import KeySet
from agentstream.models import load_model
from agentstream.pipeline import sdk
from agentstream.pipeline.proxy.access import proxy_client_key
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.runner.agl import AgentProcessFailed, adapt_agent
from agentstream.pipeline.runner.pool import Runner, RunnerOptions
from agentstream.pipeline.runner.tasks import enqueue, make_task
from agentstream.serving.app import create_app
from tests.support import agl_agents
from tests.support.http_thread import ServerThread
from tests.support.readback import Landed, read_topic

PROXY_KEYS = "k-stack-1,k-stack-2"


def keyed(config: Config, keys: str | None) -> Config:
    """``config`` with ``[security] proxy_keys`` set to ``keys`` (None: unset), as the clients would load it."""
    return replace(config, security=replace(config.security, proxy_keys=Secret(keys) if keys is not None else None))


@pytest.fixture(scope="module")
def upstream():
    running = ServerThread(create_app(load_model("tiny"), max_tokens=8))
    yield running
    running.stop()


@pytest.fixture
def proxy(upstream, publisher: SpanPublisher):
    running = ServerThread(LLMProxy(upstream.url, publisher, keys=KeySet(Secret(PROXY_KEYS))).app)
    yield running
    running.stop()


def read_spans(config: Config, kafka_options: dict, done) -> Landed:
    return read_topic(kafka_options, topic_name(config.topics, "spans"), done, timeout_s=30)


@pytest.mark.parametrize("client_keys, presents", [(PROXY_KEYS, True), ("k-wrong", False), (None, False)],
                         ids=["configured", "wrong", "none"])
def test_the_runner_presents_the_configured_key(client_keys, presents, proxy, publisher, topics_config, stack,
                                                kafka_options):
    config = keyed(topics_config, client_keys)
    tasks = [make_task(task, agent_name="arithmetic", max_attempts=1, timeout_s=60)
             for task in arithmetic.all_tasks()[:3]]
    asyncio.run(enqueue(config, stack.bootstrap_servers, tasks))
    runner = Runner(arithmetic.solve, config, stack.bootstrap_servers, publisher,
                    RunnerOptions(concurrency=3, group_id=f"runners-keys-{client_keys}", proxy_url=proxy.url,
                                  session_timeout_ms=3000))
    stats = asyncio.run(asyncio.wait_for(runner.run(max_tasks=len(tasks)), 90))
    publisher.flush(10)
    landed = read_spans(config, kafka_options, lambda got: sum(
        1 for e in got.events if e["event"] in ("SUCCEEDED", "FAILED")) >= len(tasks))
    assert (stats.succeeded, stats.failed) == ((3, 0) if presents else (0, 3))
    for task in tasks:
        spans, events = landed.of(task["rollout_id"])
        llm = [s for s in spans if s["kind"] == "LLM"]
        if presents:
            assert [e["event"] for e in events if e["event"] != "HEARTBEAT"] == ["STARTED", "SUCCEEDED"]
            assert len(llm) == 1 and llm[0]["prompt_token_ids"] and llm[0]["response_token_ids"]
            assert llm[0]["agent_name"] == "arithmetic" and llm[0]["status"] == "OK"
        else:
            assert not llm, "a refused call reaches no model and records no LLM span"
            (failed,) = [e for e in events if e["event"] == "FAILED"]
            assert failed["error"].startswith("AuthenticationError") and "401" in failed["error"]
            (refusal,) = [s for s in spans if s["kind"] == "EXCEPTION"]
            assert "not one of this proxy's keys" in refusal["attributes"]["exception.message"]


def test_the_gates_evaluation_presents_the_configured_key(proxy, publisher, topics_config, kafka_options, tmp_path):
    tasks = tmp_path / "eval.jsonl"
    tasks.write_text("".join(json.dumps(task) + "\n" for task in arithmetic.all_tasks()[:2]))
    settings = replace(topics_config.deploy, eval_agent="agentstream.examples.arithmetic:solve", eval_tasks=str(tasks))
    score = asyncio.run(task_evaluator(replace(keyed(topics_config, PROXY_KEYS), deploy=settings), proxy.url, "tiny",
                                       publisher)(0))
    assert score.tasks == 2
    with pytest.raises(EvaluationError, match="401"):  # a refused call is an evaluation error, never a score of 0
        asyncio.run(task_evaluator(replace(keyed(topics_config, "k-wrong"), deploy=settings), proxy.url, "tiny",
                                   publisher)(0))
    publisher.flush(10)
    landed = read_spans(topics_config, kafka_options, lambda got: sum(
        1 for s in got.spans if s["kind"] == "AGENT" and s["agent_name"] == GATE_AGENT) >= 8)
    roots = [s for s in landed.spans if s["kind"] == "AGENT" and s["agent_name"] == GATE_AGENT]
    llm = [s for s in landed.spans if s["kind"] == "LLM" and s["agent_name"] == GATE_AGENT]
    assert len(roots) == 2 + 2 * EVAL_ATTEMPTS, "each refused task was tried EVAL_ATTEMPTS times"
    assert len(llm) == 2 and all(s["response_token_ids"] for s in llm), "only the configured key's calls passed"


def test_agent_lightning_agents_present_the_key(proxy, publisher, topics_config, kafka_options):
    key = proxy_client_key(keyed(topics_config, PROXY_KEYS))
    assert key == "k-stack-1"
    agl03 = adapt_agent(agl_agents.LetterAgent(), "tests.support.agl_agents:LetterAgent", AglConfig(model="tiny"))
    agl10 = adapt_agent(agl_agents.EnvAgent, "tests.support.agl_agents:EnvAgent", AglConfig())
    assert agl03 is not None and agl10 is not None

    async def run(agent, rollout_id: str, proxy_key: str | None) -> None:
        with sdk.rollout("agl", rollout_id=rollout_id, sink=publisher, proxy_url=proxy.url,
                         proxy_key=proxy_key) as state:
            await agent({"prompt": "Write letters."}, state)

    asyncio.run(run(agl03, "agl03-keyed", key))
    asyncio.run(run(agl10, "agl10-keyed", key))
    with pytest.raises(openai.AuthenticationError, match="not one of this proxy's keys"):
        asyncio.run(run(agl03, "agl-unkeyed", None))
    with pytest.raises(AgentProcessFailed, match="AuthenticationError"):
        asyncio.run(run(agl10, "agl-unkeyed", None))
    publisher.flush(10)
    landed = read_spans(topics_config, kafka_options,
                        lambda got: len(got.of("agl03-keyed")[0]) >= 2 and len(got.of("agl10-keyed")[0]) >= 3)
    for rollout_id in ("agl03-keyed", "agl10-keyed"):
        llm = [s for s in landed.of(rollout_id)[0] if s["kind"] == "LLM"]
        assert len(llm) == 1 and llm[0]["response_token_ids"], rollout_id
    rewards = [s for s in landed.of("agl10-keyed")[0] if s["kind"] == "REWARD"]
    assert len(rewards) == 1, "the 1.0 agent's reward event passed the key check with AGL_KEY"
    assert not [s for s in landed.of("agl-unkeyed")[0] if s["kind"] in ("LLM", "REWARD")]


def test_the_client_key_is_the_first_configured_one(topics_config):
    assert proxy_client_key(keyed(topics_config, " k-a , k-b")) == "k-a"
    assert proxy_client_key(keyed(topics_config, " , ")) is None
    assert proxy_client_key(keyed(topics_config, None)) is None

"""The calculator agent on agent frameworks, each as its users write it, through the proxy to the dev server.

The dev server runs a scripted model that always calls the calculator, so each rollout is a whole tool
loop: the test checks that every model call the framework made is an LLM span carrying the ids the server
generated, that the tool result the framework sent back is in the next call's prompt ids, and that a
framework's calls extend each other's token prefix (what trajectory-level credit merges on) exactly where the
plain-SDK agent's do, on the same server: the framework's API (the Responses API for the Agents SDK) changes
nothing the model sees between turns.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import uuid

import pytest

from agentstream.examples import CALCULATOR_FRAMEWORKS, calculator_agent
from agentstream.infra.kafka import topic_name
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.sdk import Rollout
from agentstream.serving.app import create_app
from tests.support.http_thread import ServerThread
from tests.support.readback import read_topic
from tests.support.servers import scripted

pytestmark = pytest.mark.integration

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
TASK = {"id": "t", "prompt": "Compute 6*7.", "answer": 42, "model": "scripted"}


def first_difference(earlier: dict, later: dict) -> int | None:
    """Where ``later``'s prompt stops repeating what ``earlier`` saw and generated (None: it extends it, a merge)."""
    seen = earlier["prompt_token_ids"] + earlier["response_token_ids"]
    return next((index for index, (a, b) in enumerate(zip(seen, later["prompt_token_ids"], strict=False))
                 if a != b), None if len(later["prompt_token_ids"]) >= len(seen) else len(later["prompt_token_ids"]))


def rollout_spans(agent, proxy_url: str, publisher, topics_config, kafka_options) -> tuple[float, list[dict]]:
    rollout_id = f"r-{agent.__name__.rsplit('.', 1)[-1]}-{uuid.uuid4().hex[:8]}"
    score = asyncio.run(agent.solve(TASK, Rollout(rollout_id, f"{rollout_id}-1", proxy_url=proxy_url)))
    publisher.flush(10)
    landed = read_topic(kafka_options, topic_name(topics_config.topics, "spans"),
                        lambda got: len(got.of(rollout_id)[0]) >= calculator_agent.MAX_TURNS, timeout_s=20)
    return score, sorted(landed.of(rollout_id)[0], key=lambda span: span["start_time_us"])


@pytest.mark.parametrize("framework", [name for name in CALCULATOR_FRAMEWORKS if name != "openai"])
def test_a_framework_calculator_is_captured_call_by_call(framework, publisher, topics_config, kafka_options):
    loaded = scripted(CALL)
    upstream = ServerThread(create_app(loaded))
    proxy = ServerThread(LLMProxy(upstream.url, publisher, agent_name=f"calc-{framework}").app)
    try:
        agent = importlib.import_module(CALCULATOR_FRAMEWORKS[framework])
        score, spans = rollout_spans(agent, proxy.url, publisher, topics_config, kafka_options)
        _, plain = rollout_spans(calculator_agent, proxy.url, publisher, topics_config, kafka_options)
    finally:
        proxy.stop()
        upstream.stop()
    assert score == 0.0, "the scripted model only ever calls the tool, so the agent runs out of turns"
    assert [span["kind"] for span in spans] == ["LLM"] * calculator_agent.MAX_TURNS
    for span in spans:
        assert span["agent_name"] == f"calc-{framework}"
        assert loaded.tokenizer.decode(span["response_token_ids"], skip_special_tokens=True) == CALL
        assert "calculator" in span["attributes"]["gen_ai.tool.definitions"]
    sent = json.loads(spans[1]["attributes"]["gen_ai.input.messages"])
    assert [message["role"] for message in sent] == ["system", "user", "assistant", "tool"]
    assert sent[-1]["content"] == "42" and sent[-1]["tool_call_id"] == sent[-2]["tool_calls"][0]["id"]
    assert "<tool_response>\n42\n</tool_response>" in loaded.tokenizer.decode(spans[1]["prompt_token_ids"])
    # where each next prompt departs from the last call's tokens, measured from that call's response
    departs = [(index - len(a["prompt_token_ids"])) if index is not None else None
               for a, b in itertools.pairwise(spans) for index in [first_difference(a, b)]]
    plain_departs = [(index - len(a["prompt_token_ids"])) if index is not None else None
                     for a, b in itertools.pairwise(plain) for index in [first_difference(a, b)]]
    assert departs == plain_departs, f"{framework}'s turns break or merge exactly where the plain SDK's do"

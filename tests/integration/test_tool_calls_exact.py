"""Tool calls exact through the proxy on both contracts: SmolLM2 writes a ``<tool_call>``, the official openai SDK
sends it back the standard way, and the next call's prompt ids extend the previous call's prompt and response ids.

SmolLM2-135M-Instruct makes no tool calls on its own (docs/measured.md); asked greedily to repeat a call in the
canonical form, it writes it token for token, which gives a real model's tool call deterministically.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from agentstream.infra.kafka import topic_name
from agentstream.models import LoadedModel, load_model
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.serving.app import create_app
from agentstream.serving.protocol import Contract
from agentstream.serving.tool_format import canonical_tool_call
from tests.support.http_thread import ServerThread
from tests.support.readback import read_topic
from tests.support.servers import assert_exact

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
CALL = canonical_tool_call("calculator", {"expression": "47*83+5"})
ASK = [{"role": "user", "content": f"Repeat after me:\n{CALL}"}]


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


@pytest.fixture(scope="module", params=[Contract.DEV, Contract.VLLM], ids=str)
def upstream(request, smollm2: LoadedModel) -> Iterator[ServerThread]:
    running = ServerThread(create_app(smollm2, contract=request.param))
    yield running
    running.stop()


@pytest.fixture
def proxy(upstream: ServerThread, publisher: SpanPublisher) -> Iterator[ServerThread]:
    running = ServerThread(LLMProxy(upstream.url, publisher).app)
    yield running
    running.stop()


def llm_spans(publisher: SpanPublisher, config, kafka_options, rollout_id: str, count: int) -> list[dict]:
    """The rollout's LLM spans as they landed on the spans topic, in call order."""
    publisher.flush(10)
    landed = read_topic(kafka_options, topic_name(config.topics, "spans"),
                        lambda got: len(got.of(rollout_id)[0]) >= count, timeout_s=20)
    spans = landed.of(rollout_id)[0]
    assert len(spans) == count, f"expected {count} spans for {rollout_id}, got {len(spans)}"
    return sorted(spans, key=lambda s: s["start_time_us"])


def test_a_tool_call_is_recorded_exactly_and_the_next_prompt_extends_it(proxy, smollm2, publisher, topics_config,
                                                                        kafka_options):
    client = openai.OpenAI(base_url=f"{proxy.url}/rollouts/r-tools/v1", api_key="unused", max_retries=0)
    first = client.chat.completions.create(model=smollm2.name, messages=ASK, tools=[CALCULATOR], max_tokens=48,
                                           temperature=0, logprobs=True, extra_body={"return_token_ids": True})
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "47*83+5"})
    generated = choice.model_extra["token_ids"]
    assert generated[-1] == smollm2.tokenizer.eos_token_id, "the turn ended with the model's own end token"

    conversation = [*ASK, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "3906"}]
    second = client.chat.completions.create(model=smollm2.name, messages=conversation, tools=[CALCULATOR],
                                            max_tokens=4, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")

    tool_span, answer_span = llm_spans(publisher, topics_config, kafka_options, "r-tools", 2)
    # (a) the span holds exactly the ids the server generated, and they spell the call the model wrote
    assert tool_span["response_token_ids"] == generated
    assert tool_span["prompt_token_ids"] == first.model_extra["prompt_token_ids"]
    assert smollm2.tokenizer.decode(generated, skip_special_tokens=True) == CALL
    assert_exact(smollm2, smollm2.model, tool_span["prompt_token_ids"], generated, None,
                 tool_span["response_logprobs"], 1.0)
    # (b) sent back the standard way, the call re-renders into the same tokens: the next prompt extends them
    sequence = tool_span["prompt_token_ids"] + tool_span["response_token_ids"]
    assert answer_span["prompt_token_ids"][:len(sequence)] == sequence
    glue = smollm2.tokenizer.decode(answer_span["prompt_token_ids"][len(sequence):])
    assert glue == "\n<|im_start|>user\n<tool_response>\n3906\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

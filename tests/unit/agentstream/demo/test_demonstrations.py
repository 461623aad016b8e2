"""Calls recorded without the proxy (``ags.emit_llm_call``) and the calculator demo's demonstrations built on it."""

from __future__ import annotations

import json

import pytest

import agentstream as ags
from agentstream.demo.demonstrations import demonstration_calls, publish_demonstrations
from agentstream.examples import calculator_agent
from agentstream.models import load_model
from agentstream.schemas import SPAN, AvroCodec
from agentstream.serving.tool_format import parse_tool_calls
from tests.support.sinks import ListSink


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("smollm2").tokenizer


def test_a_call_with_logprobs_trains_like_a_captured_one_and_one_without_is_a_demonstration():
    sink = ListSink()
    with ags.rollout("teacher", sink=sink):
        ags.emit_llm_call([1, 2, 3], [4, 5], model="m", logprobs=[-0.5, -0.25], policy_version=3)
        ags.emit_llm_call([1, 2, 3], [6], model="m", messages=[{"role": "user", "content": "hi"}],
                          output=[{"role": "assistant", "content": "x"}])
    sampled, demonstrated = sink.of("LLM")
    assert sampled["response_logprobs"] == [-0.5, -0.25] and sampled["policy_version"] == 3
    assert "agentstream.demonstration" not in sampled["attributes"]
    assert demonstrated["response_logprobs"] == [] and demonstrated["attributes"]["agentstream.demonstration"] == "true"
    assert json.loads(demonstrated["attributes"]["gen_ai.input.messages"]) == [{"role": "user", "content": "hi"}]
    codec = AvroCodec()
    for span in (sampled, demonstrated):  # both are valid Span records
        assert codec.decode(codec.encode(SPAN, span))[1]["response_token_ids"] == span["response_token_ids"]


@pytest.mark.parametrize(("prompt", "response", "logprobs", "message"), [
    ([], [1], None, "needs prompt and response"),
    ([1], [], None, "needs prompt and response"),
    ([1], [2, 3], [-1.0], "1 logprobs for 2 response tokens"),
])
def test_calls_that_cannot_be_trained_on_are_refused(prompt, response, logprobs, message):
    sink = ListSink()
    with ags.rollout("teacher", sink=sink), pytest.raises(ags.TokenMismatch, match=message):
        ags.emit_llm_call(prompt, response, model="m", logprobs=logprobs)
    assert not sink.of("LLM")


def test_a_demonstration_is_the_correct_conversation_and_each_turn_extends_the_last(tokenizer):
    task = calculator_agent.split()[1][0]
    messages = calculator_agent.demonstration(task)
    assert messages[3]["content"] == str(task["answer"])  # what the calculator answers
    assert calculator_agent.reward(messages[-1]["content"], task["answer"]) == 1.0
    (first_prompt, first), (second_prompt, second) = demonstration_calls(
        messages, [calculator_agent.CALCULATOR], tokenizer, tokenizer.eos_token_id)
    call = parse_tool_calls(tokenizer.decode(first[:-1])).tool_calls  # what the server would parse out of it
    assert [c["function"]["name"] for c in call] == ["calculator"]
    assert json.loads(call[0]["function"]["arguments"]) == {"expression": calculator_agent.expression(task)}
    assert second_prompt[:len(first_prompt) + len(first)] == first_prompt + first  # a trajectory sample merges
    assert first[-1] == second[-1] == tokenizer.eos_token_id


def test_publishing_demonstrations_records_one_rewarded_rollout_each(tokenizer):
    sink = ListSink()
    ags.set_sink(sink)
    try:
        tasks = calculator_agent.split()[0][:3]
        calls = publish_demonstrations(tasks, calculator_agent.demonstration, [calculator_agent.CALCULATOR],
                                       tokenizer, model="SmolLM2-135M-Instruct", agent_name="calc-demonstrations")
    finally:
        ags.set_sink(None)
    assert calls == 6 and len(sink.of("LLM")) == 6 and [r["reward"] for r in sink.rewards()] == [1.0] * 3
    assert {span["task_id"] for span in sink.spans} == {task["id"] for task in tasks}
    assert all(span["attributes"]["agentstream.train"] == "true" for span in sink.spans)

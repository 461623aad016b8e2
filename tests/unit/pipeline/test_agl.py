"""Agent Lightning agents through the runner's calling convention: resources by name, sync and async, rewards."""

from __future__ import annotations

import asyncio
import json

import pytest

import agentstream.agl as agl
from agentstream.infra.config import AglConfig
from agentstream.pipeline import sdk
from agentstream.pipeline.runner.agl import adapt_agent, forward_span, install_tracer, is_agl1_agent, task_environment
from agentstream.pipeline.runner.pool import call_agent, load_agent
from tests.support.sinks import ListSink

SETTINGS = AglConfig(model="tiny", temperature=0.7, prompt_template="Solve {question}")


seen: dict[str, dict] = {}


@agl.rollout
def sync_llm(task, llm):
    seen["sync_llm"] = {"llm": llm}
    return 0.5


@agl.rollout
async def async_llm(task, llm, rollout):
    seen["async_llm"] = {"llm": llm, "rollout": rollout}
    agl.emit_reward({"accuracy": 1.0, "brevity": 0.25}, primary_key="accuracy")


@agl.llm_rollout
def llm_only(task, llm, rollout):
    seen["llm_only"] = {"llm": llm, "rollout": rollout}
    agl.emit_message("thinking", attributes={"step": 1})
    agl.emit_object({"plan": [1, 2]})
    return True


@agl.prompt_rollout
async def with_prompt(task, prompt_template):
    seen["with_prompt"] = {"text": prompt_template.format(question=task["question"])}
    return 2


class Subclass(agl.LitAgent):
    async def rollout_async(self, task, resources, rollout):
        seen["Subclass"] = {"resources": resources, "rollout": rollout}
        return 0.75


class Validating(agl.LitAgent):
    def training_rollout(self, task, resources, rollout):
        return 1.0

    def validation_rollout(self, task, resources, rollout):
        return -1.0


async def drive(obj, task, train=None):
    adapted = adapt_agent(obj, "tests:agent", SETTINGS)
    assert adapted is not None
    sink = ListSink()
    with sdk.rollout("agent", rollout_id="r1", attempt_id="r1-a1", sink=sink, proxy_url="http://proxy:1",
                     train=train) as state:
        result = await call_agent(adapted, task, state)
    return result, sink


def test_decorated_functions_get_their_resources_by_name_sync_and_async():
    assert not sync_llm.is_async() and async_llm.is_async()
    result, _ = asyncio.run(drive(sync_llm, {"q": 1}))
    assert result == 0.5
    llm = seen["sync_llm"]["llm"]
    assert isinstance(llm, agl.LLM) and llm.model == "tiny"
    assert llm.endpoint == "http://proxy:1/rollouts/r1/attempts/r1-a1/agents/agent/v1"
    assert llm.sampling_parameters == {"temperature": 0.7}

    result, sink = asyncio.run(drive(async_llm, {"q": 1}))
    assert result is None
    rollout = seen["async_llm"]["rollout"]
    assert (rollout.rollout_id, rollout.attempt.attempt_id, rollout.mode, rollout.input) == ("r1", "r1-a1", "train",
                                                                                             {"q": 1})
    (reward,) = sink.of("REWARD")
    assert reward["reward"] == 1.0 and reward["reward_dimensions"] == {"accuracy": 1.0, "brevity": 0.25}


def test_llm_rollout_messages_objects_and_a_bool_return():
    result, sink = asyncio.run(drive(llm_only, {}))
    assert result == 1.0  # Agent Lightning reads True as the reward 1.0
    assert seen["llm_only"]["rollout"].rollout_id == "r1"
    (message,) = sink.of("MESSAGE")
    assert message["attributes"]["message"] == "thinking" and message["attributes"]["step"] == "1"
    (obj,) = sink.of("OBJECT")
    assert json.loads(obj["attributes"]["object"]) == {"plan": [1, 2]}


def test_prompt_template_and_litagent_subclasses():
    result, _ = asyncio.run(drive(with_prompt, {"question": "2+2"}))
    assert result == 2.0 and seen["with_prompt"]["text"] == "Solve 2+2"
    result, _ = asyncio.run(drive(Subclass, {"x": 1}))  # the class itself: the runner instantiates it
    assert result == 0.75
    resources = seen["Subclass"]["resources"]
    assert set(resources) == {"main_llm", "prompt_template"}
    assert resources["main_llm"].get_base_url("r1", "r1-a1") == resources["main_llm"].endpoint


def test_evaluation_tasks_call_the_validation_rollout():
    assert asyncio.run(drive(Validating(), {}))[0] == 1.0
    assert asyncio.run(drive(Validating(), {}, train=False))[0] == -1.0


def test_agent_lightning_rules_for_rewards_hold():
    with pytest.raises(ValueError, match="primary_key"):
        asyncio.run(drive(agl.rollout(lambda_reward), {}))
    with pytest.raises(NotImplementedError):
        agl.rollout(lambda task, other: None)
    assert agl.emit_reward(1.0, propagate=False) is None


def lambda_reward(task, llm):
    agl.emit_reward({"a": 1.0})


def test_plain_agentstream_agents_are_left_alone_and_1_0_classes_are_recognised():
    def plain(task, rollout):
        return 1.0

    assert adapt_agent(plain, "m:plain") is None
    assert load_agent("tests.support.agl_agents:rollout_llm").__name__ == "rollout_llm"
    assert load_agent("tests.support.agl_agents:AllStyles").__name__ == "AllStyles"
    from tests.support.agl_agents import EnvAgent
    assert is_agl1_agent(EnvAgent) and not is_agl1_agent(Subclass)
    assert not install_tracer()  # the real package is not in this environment


def test_agent_lightning_spans_become_agentstream_spans():
    sink = ListSink()
    with sdk.rollout("agent", rollout_id="r2", sink=sink):
        forward_span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                                   "agentlightning.reward.0.value": 0.5})
        forward_span("agentlightning.annotation", {
            "agentlightning.reward.0.name": "task", "agentlightning.reward.0.value": 1.0,
            "agentlightning.reward.1.name": "cost", "agentlightning.reward.1.value": -0.5})
        forward_span("agentlightning.message", {"agentlightning.message.body": "hi"})
        forward_span("agentlightning.object", {"agentlightning.object.json": "[1, 2]"})
        forward_span("agentlightning.exception", {"exception.type": "KeyError", "exception.message": "x"})
    rewards = sink.of("REWARD")
    assert [(r["reward"], r["reward_dimensions"]) for r in rewards] == [(0.5, None),
                                                                      (1.0, {"task": 1.0, "cost": -0.5})]
    assert sink.of("MESSAGE")[0]["attributes"]["message"] == "hi"
    assert json.loads(sink.of("OBJECT")[0]["attributes"]["object"]) == [1, 2]
    assert sink.of("EXCEPTION")[0]["status_message"] == "KeyError: x"


def test_a_1_0_agent_gets_its_task_as_environment_variables():
    task = {"question": "2+2", "answer": 4, "meta": {"level": 1}}
    assert task_environment(task, "") == {"QUESTION": "2+2", "ANSWER": "4", "META": '{"level": 1}'}
    assert task_environment(task, "Q=input.question, LEVEL=input.meta.level, KIND=math") == {
        "Q": "2+2", "LEVEL": "1", "KIND": "math"}

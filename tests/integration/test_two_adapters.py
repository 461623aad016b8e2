"""Two trained models on one base model and one model server: each request is answered by its own model's adapter.

Two agents train two LoRA adapters of the same base model (``[trainer] model_name`` tells them
apart). One dev model server, on vLLM's contract, answers to both names (``--served-model-name``
twice, as vLLM's aliases) and holds both adapters at once; a hot swap per model loads its
checkpoints and promotes them; one proxy routes each request by the model it names. Interleaved,
concurrent requests for both models go through the proxy with the official openai SDK, and every
answer's logprobs are checked against the trained policy of the model it named, and against the
other's.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace

import openai
import pytest
import torch

from agentstream.deploy.deployments import DeploymentFollower, DeploymentLog, Routing, adapter_name
from agentstream.deploy.gate import Gate
from agentstream.evaluation import task_evaluator
from agentstream.infra.config import TrainerConfig
from agentstream.infra.kafka import create_topics, topic_name
from agentstream.infra.processes import free_port
from agentstream.models import load_model, teacher_forced_logprobs
from agentstream.pipeline.proxy.server import LLMProxy, serve_proxy
from agentstream.serving.app import create_app
from agentstream.serving.handlers import SERVER
from agentstream.serving.hotswap import HotSwapper
from agentstream.serving.protocol import Contract
from agentstream.trainer.checkpoint_writer import open_store
from tests.integration.test_trainer_hotswap import trained_policy
from tests.support.deploy_scenario import (
    EXACT_AGENT,
    Users,
    greedy_tasks,
    lora_checkpoint,
    publish,
    routed_proxy,
    serve_app,
    wait_until,
)
from tests.support.readback import read_topic
from tests.support.streams_harness import Worker, worker_env

MESSAGES = [{"role": "user", "content": "hello"}]
REQUESTS = 24


def served_logprobs(payload: dict) -> list[float]:
    return [entry["logprob"] for entry in payload["choices"][0]["logprobs"]["content"]]


def policy_logprobs(policy, payload: dict) -> list[float]:
    """What ``policy`` gives the tokens the server generated, after the prompt it saw."""
    with torch.no_grad():
        return teacher_forced_logprobs(policy.model, payload["prompt_token_ids"],
                                       payload["choices"][0]["token_ids"], 1.0)


def test_two_models_share_one_server_and_every_answer_comes_from_the_adapter_of_the_model_it_named(
        topics_config, tmp_path, stack, publisher, clickhouse, kafka_options):
    tag = uuid.uuid4().hex[:8]
    models = {"calc": (f"calc-{tag}", 0, 1), "words": (f"words-{tag}", 1, 3)}  # name, trainer seed, version
    configs = {key: replace(topics_config, trainer=TrainerConfig(
        model="tiny", model_name=name, device="cpu", threads=1, lr=5e-2, grad_clip=1e9, lora=True, lora_r=4,
        lora_alpha=16, seed=seed)) for key, (name, seed, _) in models.items()}
    config = configs["calc"]
    asyncio.run(create_topics(config, stack.bootstrap_servers))
    store = open_store(str(tmp_path / "checkpoints"))
    policies = {key: trained_policy(configs[key].trainer) for key in models}
    names = {key: name for key, (name, _, _) in models.items()}
    versions = {key: version for key, (_, _, version) in models.items()}
    answers: list[tuple[str, dict]] = []

    async def scenario() -> None:
        server_runner, server_url = await serve_app(create_app(
            load_model("tiny"), served_model_names=tuple(names.values()), contract=Contract.VLLM))
        server = server_runner.app[SERVER]
        try:
            async with routed_proxy({names[key]: configs[key] for key in models}, stack.bootstrap_servers,
                                    clickhouse, server_url, publisher) as (proxy_url, follower):
                for key in models:
                    await publish(configs[key], stack.bootstrap_servers, policies[key], versions[key], store)
                for key in models:
                    await wait_until(
                        lambda k=key: (r := follower.routing(names[k])) and r.stable_version == versions[k],
                        what=f"{names[key]} v{versions[key]} promoted")
                assert sorted(server.adapters) == sorted(adapter_name(names[k], versions[k]) for k in models)

                async def ask(i: int) -> None:
                    key = ("calc", "words")[i % 2]
                    client = openai.AsyncOpenAI(base_url=f"{proxy_url}/rollouts/two-{tag}-{i}/v1",
                                                api_key="unused", max_retries=0)
                    response = await client.chat.completions.create(
                        model=names[key], messages=MESSAGES, max_tokens=6, logprobs=True,
                        extra_body={"return_token_ids": True})
                    assert response.model == adapter_name(names[key], versions[key])
                    answers.append((key, response.model_dump()))

                await asyncio.gather(*(ask(i) for i in range(REQUESTS)))
                assert server.batcher.merged.merges > 0
        finally:
            await server_runner.cleanup()

    asyncio.run(scenario())
    assert len(answers) == REQUESTS
    wrong = []
    for key, payload in answers:
        other = "words" if key == "calc" else "calc"
        served = served_logprobs(payload)
        mine, theirs = policy_logprobs(policies[key], payload), policy_logprobs(policies[other], payload)
        assert served == pytest.approx(mine, abs=1e-4)
        if served == pytest.approx(theirs, abs=1e-3):
            wrong.append(payload["id"])
    assert wrong == []  # the two adapters differ enough that an answer from the other one would show

    publisher.flush()
    landed = read_topic(kafka_options, topic_name(config.topics, "spans"),
                        lambda got: sum(s["kind"] == "LLM" and s["rollout_id"].startswith(f"two-{tag}-")
                                        for s in got.spans) >= REQUESTS)
    llm = {s["rollout_id"]: s for s in landed.spans if s["kind"] == "LLM" and s["rollout_id"].startswith(f"two-{tag}-")}
    for i in range(REQUESTS):
        key = ("calc", "words")[i % 2]
        span = llm[f"two-{tag}-{i}"]
        assert (span["model"], span["policy_version"]) == (names[key], versions[key])


def test_each_model_has_its_own_gate_which_rejects_its_broken_candidate_while_the_other_promotes_its_own(
        topics_config, tmp_path, stack, publisher, clickhouse):
    """Two agents' adapters of one base model, one server, one proxy, one deployments log, a gate per model.

    One agent's trainer writes a broken checkpoint and the other's a good one, at the same moment.
    Each gate judges only its own model's candidate: the broken one is rejected on the held-out
    tasks and never serves, the good one goes through its canary on the live traffic of its own
    model and is promoted; neither decision moves the other model's routing.
    """
    tag = uuid.uuid4().hex[:8]
    names = {"calc": f"calc-{tag}", "words": f"words-{tag}"}
    configs = {key: replace(topics_config, trainer=TrainerConfig(
        model="tiny", model_name=name, device="cpu", threads=1, lora=True, lora_r=4, lora_alpha=16))
        for key, name in names.items()}
    asyncio.run(create_topics(configs["calc"], stack.bootstrap_servers))
    store = open_store(str(tmp_path / "checkpoints"))
    seen: list[tuple[str, int, str]] = []

    async def scenario() -> dict[str, int | None]:
        server_runner, server_url = await serve_app(create_app(
            load_model("tiny"), served_model_names=tuple(names.values()), contract=Contract.VLLM))
        prompts = [f"Say something about the number {number}." for number in range(6)]
        tasks = {key: await greedy_tasks(server_url, name, prompts, prefix=key) for key, name in names.items()}
        gated = {}
        for key in names:
            task_file = tmp_path / f"eval-{key}.jsonl"
            task_file.write_text("\n".join(json.dumps(task) for task in tasks[key]))
            gated[key] = replace(configs[key], deploy=replace(
                configs[key].deploy, gate=True, eval_agent=EXACT_AGENT, eval_tasks=str(task_file), tolerance=0.05,
                canary_share=0.5, canary_min_s=3.0, canary_max_s=90.0, canary_min_rollouts=8))
        stop = asyncio.Event()
        decisions = DeploymentLog(gated["calc"], stack.bootstrap_servers, clickhouse)
        await decisions.start()
        follower = DeploymentFollower(gated["calc"], stack.bootstrap_servers,
                                      on_decision=lambda d: seen.append((d.model, d.version, str(d.action))))
        background = [asyncio.create_task(follower.run(stop))]
        background += [asyncio.create_task(HotSwapper(gated[key], stack.bootstrap_servers, server_url, name,
                                                      deployments=decisions).run(stop)) for key, name in names.items()]
        proxy_runner = await serve_proxy(LLMProxy(server_url, publisher, deployments=follower), "127.0.0.1",
                                         port := free_port())
        proxy = f"http://127.0.0.1:{port}"
        users = Users(proxy, publisher, tasks["calc"] + tasks["words"])  # live traffic on both models
        background.append(asyncio.create_task(users.run(stop)))
        background += [asyncio.create_task(Gate(
            gated[key], stack.bootstrap_servers, name, evaluate=task_evaluator(gated[key], proxy, name, publisher),
            warehouse=clickhouse, deployments=decisions, server_url=server_url, poll_s=0.5).run(stop))
            for key, name in names.items()]
        try:
            await asyncio.wait_for(follower.ready.wait(), 20)
            await asyncio.gather(
                publish(gated["calc"], stack.bootstrap_servers, lora_checkpoint(gated["calc"], broken=True), 1, store),
                publish(gated["words"], stack.bootstrap_servers, lora_checkpoint(gated["words"], broken=False), 1,
                        store))
            await wait_until(lambda: {(names["calc"], 1, "REJECTED"), (names["words"], 1, "PROMOTED")} <= set(seen),
                             180, "calc's v1 rejected and words' v1 promoted")
            served_before = len(users.served)
            await wait_until(lambda: len(users.served) > served_before + 6, 30, "traffic after the decisions")
            assert users.failed == []
            return {key: (follower.routing(name) or Routing(name)).stable_version for key, name in names.items()}
        finally:
            stop.set()
            await asyncio.gather(*background)
            await decisions.stop()
            await proxy_runner.cleanup()
            await server_runner.cleanup()

    worker = Worker(worker_env(tmp_path, stack, topics_config.topics.prefix, topics_config.clickhouse.database),
                    tmp_path / "streams.log").start()  # the canary is judged on live rewards in ClickHouse
    try:
        assert asyncio.run(scenario()) == {"calc": 0, "words": 1}
    finally:
        worker.stop()
    for key, expected in (("calc", ["CANDIDATE", "REJECTED"]), ("words", ["CANDIDATE", "CANARY", "PROMOTED"])):
        assert [action for model, version, action in seen if model == names[key] and version == 1] == expected
    served = dict(clickhouse.query(
        "SELECT model, groupUniqArray(policy_version) FROM spans WHERE model IN {m:Array(String)} AND kind = 'LLM' "
        "AND agent_name = 'live-agent' GROUP BY model", parameters={"m": list(names.values())}).result_rows)
    assert 1 not in served[names["calc"]]  # the rejected candidate never answered a user
    assert 1 in served[names["words"]]  # the promoted one did

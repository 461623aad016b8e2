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
import uuid
from dataclasses import replace

import openai
import pytest
import torch

from agentstream.deploy.deployments import adapter_name
from agentstream.infra.config import TrainerConfig
from agentstream.infra.kafka import create_topics, topic_name
from agentstream.models import load_model, teacher_forced_logprobs
from agentstream.serving.app import create_app
from agentstream.serving.handlers import SERVER
from agentstream.serving.protocol import Contract
from agentstream.trainer.checkpoint_writer import open_store
from tests.integration.test_trainer_hotswap import trained_policy
from tests.support.deploy_scenario import publish, routed_proxy, serve_app, wait_until
from tests.support.readback import read_topic

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

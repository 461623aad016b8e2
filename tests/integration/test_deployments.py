"""The loop closed on vLLM's contract: deployments route the proxy, spans carry the serving version, pins work.

Everything is real: the dev model server in ``--contract vllm`` mode (no X-Policy-Version,
adapters by name; the routing test runs on the dev contract too), hot swap following the
checkpoints and deployments topics of the test broker, the proxy following deployments, the
gate, a streams worker, the official openai SDK as the client, the CLI as a user types it,
and the decisions read back from Kafka and ClickHouse.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace

import aiohttp
import openai
import pytest

from agentstream.deploy.deployments import Action, DeploymentFollower, DeploymentLog, Routing, adapter_name, decide
from agentstream.infra.config import TrainerConfig
from agentstream.infra.kafka import create_topics, topic_name
from agentstream.infra.processes import free_port
from agentstream.models import load_model
from agentstream.pipeline.proxy.server import LLMProxy, serve_proxy
from agentstream.serving.app import create_app
from agentstream.serving.handlers import SERVER
from agentstream.serving.hotswap import HotSwapper
from agentstream.serving.protocol import Contract
from agentstream.trainer.checkpoint_writer import open_store
from agentstream.trainer.metrics import MetricsWriter
from agentstream.trainer.worker import TrainerWorker
from tests.integration.test_trainer_hotswap import trained_policy
from tests.support.deploy_scenario import (
    EXACT_AGENT,
    LENIENT_AGENT,
    Users,
    greedy_tasks,
    lora_checkpoint,
    publish,
    routed_proxy,
    serve_app,
    wait_until,
)
from tests.support.readback import read_topic

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def lora_setup(topics_config, tmp_path, stack):
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    trainer = TrainerConfig(model="tiny", model_name=name, device="cpu", threads=1, lr=5e-2, grad_clip=1e9,
                            lora=True, lora_r=4, lora_alpha=16)
    config = replace(topics_config, trainer=trainer)
    asyncio.run(create_topics(config, stack.bootstrap_servers))
    return config, name, open_store(str(tmp_path / "checkpoints"))


@pytest.mark.parametrize("contract", [Contract.VLLM, Contract.DEV])
def test_the_proxy_serves_the_deployed_adapter_and_spans_carry_its_version(
        contract, lora_setup, stack, publisher, clickhouse, kafka_options):
    config, name, store = lora_setup
    policy = trained_policy(config.trainer)

    async def scenario() -> None:
        server_runner, server_url = await serve_app(create_app(load_model("tiny"), served_model_names=(name,),
                                                               contract=contract))
        server = server_runner.app[SERVER]
        try:
            async with routed_proxy({name: config}, stack.bootstrap_servers, clickhouse, server_url,
                                    publisher) as (proxy, follower):
                client = openai.AsyncOpenAI(base_url=f"{proxy}/rollouts/before/v1", api_key="unused", max_retries=0)
                first = await client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4)
                assert first.model == name  # nothing deployed yet: the base model

                for version in (1, 2):  # one after the other: hot swap skips to the newest of what it finds at once
                    await publish(config, stack.bootstrap_servers, policy, version, store)
                    routing = await wait_until(
                        lambda v=version: (r := follower.routing(name)) and r.stable_version == v and r,
                        what=f"v{version} promoted")
                assert routing.format == "lora" and routing.stable_uri.endswith("v00000002")
                assert sorted(server.adapters) == [adapter_name(name, 1), adapter_name(name, 2)]

                routed = openai.AsyncOpenAI(base_url=f"{proxy}/rollouts/after/v1", api_key="unused", max_retries=0)
                served = await routed.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4)
                assert served.model == adapter_name(name, 2)
                pinned_base = await routed.chat.completions.create(model=f"{name}@v0", messages=MESSAGES, max_tokens=4)
                assert pinned_base.model == name
                by_header = await routed.chat.completions.create(
                    model=name, messages=MESSAGES, max_tokens=4, extra_headers={"X-Agentstream-Version": "0"})
                assert by_header.model == name
                with pytest.raises(openai.NotFoundError, match=r"version 1 of model .* is not loaded") as refused:
                    await routed.chat.completions.create(model=f"{name}@v1", messages=MESSAGES, max_tokens=4)
                assert refused.value.body["code"] == 404 and "serving: v2" in refused.value.body["message"]
                streamed = await routed.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4,
                                                                stream=True)
                assert {chunk.model async for chunk in streamed} == {adapter_name(name, 2)}
        finally:
            await server_runner.cleanup()

    asyncio.run(scenario())
    publisher.flush()
    spans_topic = topic_name(config.topics, "spans")
    landed = read_topic(kafka_options, spans_topic, lambda got: len(
        [s for s in got.spans if s["kind"] == "LLM"]) >= 6)
    llm = [s for s in landed.spans if s["kind"] == "LLM"]
    by_rollout = {}
    for span in llm:
        by_rollout.setdefault(span["rollout_id"], []).append(span)
    # Before any deployment vLLM names no version (and nothing is routed); the dev server says v0.
    assert [s["policy_version"] for s in by_rollout["before"]] == [None if contract == Contract.VLLM else 0]
    after = sorted(by_rollout["after"], key=lambda s: s["start_time_us"])
    assert [s["policy_version"] for s in after] == [2, 0, 0, None, 2]
    assert {s["model"] for s in after} == {name}  # the trained model's name, never the adapter's
    assert [s["attributes"].get("agentstream.route") for s in after] == ["stable", "pinned", "pinned", None, "stable"]
    assert after[3]["status"] == "ERROR" and "not loaded" in after[3]["status_message"]
    rows = clickhouse.query("SELECT version, action, decided_by, stable_version FROM deployments FINAL "
                            "WHERE model = {m:String} ORDER BY decided_at", parameters={"m": name}).result_rows
    assert rows == [(1, str(Action.PROMOTED), "hotswap", 1), (2, str(Action.PROMOTED), "hotswap", 2)]


def test_a_stale_routing_pin_to_an_unknown_model_is_left_to_the_server(lora_setup, stack, publisher):
    """A model the deployments do not know is forwarded as named: the server's own 404 reaches the client."""
    _, name, _ = lora_setup

    async def scenario() -> None:
        server_runner, server_url = await serve_app(create_app(load_model("tiny"), served_model_names=(name,),
                                                               contract=Contract.VLLM))
        proxy_runner = await serve_proxy(LLMProxy(server_url, publisher), "127.0.0.1", port := free_port())
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                        json={"model": "elsewhere@v3", "messages": MESSAGES}) as response:
                    assert response.status == 404
                    assert (await response.json())["error"]["message"] == "The model `elsewhere@v3` does not exist."
                async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                        headers={"X-Agentstream-Train": "maybe"},
                                        json={"model": name, "messages": MESSAGES}) as response:
                    assert response.status == 400
                    assert "X-Agentstream-Train" in (await response.json())["error"]["message"]
        finally:
            await proxy_runner.cleanup()
            await server_runner.cleanup()

    asyncio.run(scenario())


def test_the_gate_rejects_a_broken_checkpoint_rolls_back_a_bad_canary_and_promotes_a_good_one(
        lora_setup, stack, publisher, clickhouse, tmp_path):
    import json

    from agentstream.deploy.deployments import Routing
    from agentstream.deploy.gate import Gate
    from agentstream.evaluation import task_evaluator
    from tests.support.streams_harness import Worker, worker_env

    base, name, store = lora_setup
    prompts = [f"Say something about the number {n}." for n in range(6)]
    env = worker_env(tmp_path, stack, base.topics.prefix, base.clickhouse.database)
    worker = Worker(env, tmp_path / "streams.log").start()

    async def scenario() -> None:
        server_runner, server_url = await serve_app(create_app(load_model("tiny"), served_model_names=(name,),
                                                               contract=Contract.VLLM))
        tasks = await greedy_tasks(server_url, name, prompts)
        task_file = tmp_path / "eval.jsonl"
        task_file.write_text("\n".join(json.dumps(t) for t in tasks))
        gated = replace(base, deploy=replace(base.deploy, gate=True, eval_agent=EXACT_AGENT,
                                             eval_tasks=str(task_file), tolerance=0.05, canary_share=0.5,
                                             canary_min_s=3.0, canary_max_s=90.0, canary_min_rollouts=8))
        stop = asyncio.Event()
        decisions = DeploymentLog(gated, stack.bootstrap_servers, clickhouse)
        await decisions.start()
        seen: list[tuple[int, str]] = []
        follower = DeploymentFollower(gated, stack.bootstrap_servers,
                                      on_decision=lambda d: seen.append((d.version, str(d.action))))
        swapper = HotSwapper(gated, stack.bootstrap_servers, server_url, name, deployments=decisions)
        background = [asyncio.create_task(swapper.run(stop)), asyncio.create_task(follower.run(stop))]
        proxy_runner = await serve_proxy(LLMProxy(server_url, publisher, deployments=follower), "127.0.0.1",
                                         port := free_port())
        proxy = f"http://127.0.0.1:{port}"
        users = Users(proxy, publisher, tasks)
        users_stop = asyncio.Event()
        background.append(asyncio.create_task(users.run(users_stop)))

        def gate_with(config) -> tuple[asyncio.Event, asyncio.Task]:
            gate_stop = asyncio.Event()
            gate = Gate(config, stack.bootstrap_servers, name, evaluate=task_evaluator(config, proxy, name, publisher),
                        warehouse=clickhouse, deployments=decisions, server_url=server_url, poll_s=0.5)
            return gate_stop, asyncio.create_task(gate.run(gate_stop))

        try:
            await asyncio.wait_for(follower.ready.wait(), 20)
            strict_stop, strict_gate = gate_with(gated)
            await publish(gated, stack.bootstrap_servers, lora_checkpoint(gated, broken=True), 1, store)
            await wait_until(lambda: (1, "REJECTED") in seen, 120, "v1 rejected by the evaluation")
            strict_stop.set()
            await strict_gate
            assert (follower.routing(name) or Routing(name)).stable_version == 0

            # An evaluation that cannot see the damage lets v2 through to the canary; live rewards catch it.
            lenient = replace(gated, deploy=replace(gated.deploy, eval_agent=LENIENT_AGENT))
            lenient_stop, lenient_gate = gate_with(lenient)
            await publish(gated, stack.bootstrap_servers, lora_checkpoint(gated, broken=True), 2, store)
            await wait_until(lambda: (2, "ROLLED_BACK") in seen, 150, "v2 rolled back during its canary")
            assert follower.routing(name).stable_version == 0 and follower.routing(name).canary_version is None

            await publish(gated, stack.bootstrap_servers, lora_checkpoint(gated, broken=False), 3, store)
            await wait_until(lambda: (3, "PROMOTED") in seen, 150, "v3 promoted through its canary")
            assert follower.routing(name).stable_version == 3
            lenient_stop.set()
            await lenient_gate
            served_before = len(users.served)
            await wait_until(lambda: len(users.served) > served_before + 6, 30, "traffic on v3")
        finally:
            users_stop.set()
            stop.set()
            await asyncio.gather(*background)
            await decisions.stop()
            await proxy_runner.cleanup()
            await server_runner.cleanup()
        assert users.failed == []
        assert [s for s in seen if s[0] in (1, 2, 3)] == [
            (1, "CANDIDATE"), (1, "REJECTED"), (2, "CANDIDATE"), (2, "CANARY"), (2, "ROLLED_BACK"),
            (3, "CANDIDATE"), (3, "CANARY"), (3, "PROMOTED")]

    try:
        asyncio.run(scenario())
        check_decisions_spans_and_training(clickhouse, name, base, stack, tmp_path)
    finally:
        worker.stop()


def check_decisions_spans_and_training(clickhouse, name: str, base, stack, tmp_path) -> None:
    rows = clickhouse.query(
        "SELECT version, action, candidate_score, stable_score, canary_reward, stable_reward, canary_rollouts, reason "
        "FROM deployments FINAL WHERE model = {m:String} ORDER BY decided_at", parameters={"m": name}).result_rows
    by_action = {(version, action): rest for version, action, *rest in rows}
    assert by_action[(1, "REJECTED")][:2] == [0.0, 1.0]  # scored 0 against the base model's 1
    canary_reward, stable_reward, canary_rollouts = by_action[(2, "ROLLED_BACK")][2:5]
    assert canary_reward < 0.5 and stable_reward == 1.0 and canary_rollouts >= 8
    assert by_action[(3, "PROMOTED")][2] == 1.0
    spans = clickhouse.query(
        "SELECT policy_version, count() FROM spans WHERE model = {m:String} AND kind = 'LLM' "
        "AND agent_name = 'live-agent' AND status = 'OK' GROUP BY policy_version ORDER BY policy_version",
        parameters={"m": name}).result_rows
    versions = {version for version, _ in spans}
    assert {0, 2, 3} <= versions  # live traffic saw the base model, v2 during its canary and v3 promoted
    assert 1 not in versions  # the rejected candidate never served a user
    assert versions <= {None, 0, 2, 3}  # None: before the first decision the proxy did not know the model was trained
    assert clickhouse.query("SELECT count() FROM transitions WHERE agent_name = 'agentstream-gate'").result_rows == [
        (0,)]  # evaluation rollouts never train

    # The trainer's lag bound holds on what vLLM served: resumed at v3 with max_policy_lag 0, it trains on the
    # transitions v3 generated and drops those of v0 (and unrouted, version 0) and v2 as stale.
    def transitions_made() -> dict[int, int]:
        return dict(clickhouse.query("SELECT policy_version, count() FROM transitions FINAL WHERE model = {m:String} "
                                     "GROUP BY policy_version", parameters={"m": name}).result_rows)

    made: dict[int, int] = {}
    while made != (made := transitions_made()):  # the last rollouts' rows land a moment after the topic's
        time.sleep(1.5)
    assert set(made) == {0, 2, 3}
    # the step comes when v3's transitions are all queued, however long reading them takes on a loaded machine
    strict = replace(base, trainer=replace(base.trainer, max_policy_lag=0, batch_transitions=made[3], batch_tokens=0,
                                           batch_wait_s=0.0, checkpoint_dir=str(tmp_path / "checkpoints")))

    async def train_one_step() -> TrainerWorker:
        trainer = TrainerWorker(strict, stack.bootstrap_servers,
                                metrics=MetricsWriter(clickhouse, base.clickhouse.database), progress=lambda line: None)
        assert (await trainer.run(max_steps=1)).steps == 1
        return trainer

    assert asyncio.run(train_one_step()).version == 4
    step = clickhouse.query("SELECT policy_version, transitions, dropped_stale FROM train_steps FINAL "
                            "WHERE model = {m:String}", parameters={"m": name}).result_rows
    [(version, trained, stale)] = step
    assert (version, trained) == (3, made[3])  # every transition v3 made, and only those
    assert 0 < stale <= made[0] + made[2]  # the v0 and v2 ones read before v3's last were dropped as stale


def test_deployments_promote_and_rollback_from_the_command_line(lora_setup, stack, clickhouse):
    config, name, _ = lora_setup
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
    env.update(KAFKA_BOOTSTRAP_SERVERS=stack.bootstrap_servers, CLICKHOUSE_URL=stack.clickhouse_url,
               CLICKHOUSE_DATABASE=config.clickhouse.database, AGENTSTREAM_TOPIC_PREFIX=config.topics.prefix)

    def agentstream(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agentstream", *args], env=env, capture_output=True, text=True,
                              timeout=120)

    empty = agentstream("deployments", "--model", name)
    assert empty.returncode == 0 and "no deployments yet" in empty.stdout
    missing = agentstream("promote", "--model", name, "--version", "7")
    assert missing.returncode == 1 and "has no checkpoint v7" in missing.stderr
    nothing = agentstream("rollback", "--model", name)
    assert nothing.returncode == 1 and "has no deployments" in nothing.stderr

    clickhouse.insert("checkpoints", [[name, 2, "file:///ckpt/v2", "ab" * 32, 2, "lora", {}, datetime.datetime.now()]],
                      column_names=["model", "version", "uri", "sha256", "step", "format", "metrics", "created_at"])
    promoted = agentstream("promote", "--model", name, "--version", "2")
    assert promoted.returncode == 0 and f"{name}: serving v2" in promoted.stdout
    listed = agentstream("deployments", "--model", name)
    assert listed.returncode == 0 and "PROMOTED" in listed.stdout and "manual" in listed.stdout
    back = agentstream("rollback", "--model", name)
    assert back.returncode == 0 and "serving the base model (v0)" in back.stdout
    rows = clickhouse.query("SELECT version, action, decided_by, stable_version FROM deployments FINAL "
                            "WHERE model = {m:String} ORDER BY decided_at", parameters={"m": name}).result_rows
    assert rows == [(2, "PROMOTED", "manual", 2), (2, "ROLLED_BACK", "manual", 0)]


def test_decisions_recorded_at_once_through_one_log_are_all_kept(topics_config, stack, clickhouse):
    """Hot swap over a fleet records from one loop per server through one log and one ClickHouse client."""
    asyncio.run(create_topics(topics_config, stack.bootstrap_servers))
    name = f"tiny-{uuid.uuid4().hex[:8]}"

    async def record_together() -> None:
        log = DeploymentLog(topics_config, stack.bootstrap_servers, clickhouse)
        await log.start()
        try:
            await asyncio.gather(*(log.record(decide(Routing(name), version, Action.PROMOTED, "hotswap", "at once",
                                                     stable_version=version)) for version in range(1, 9)))
        finally:
            await log.stop()

    asyncio.run(record_together())
    rows = clickhouse.query("SELECT version FROM deployments FINAL WHERE model = {m:String} ORDER BY version",
                            parameters={"m": name}).result_rows
    assert rows == [(version,) for version in range(1, 9)]


def test_a_gate_and_a_hot_swap_that_promotes_by_itself_refuse_to_run_side_by_side(lora_setup, stack, clickhouse):
    from agentstream.deploy.deployments import GateDisagreement
    from agentstream.deploy.gate import Gate

    config, name, _ = lora_setup
    gated = replace(config, deploy=replace(config.deploy, gate=True))
    server_url = f"http://127.0.0.1:{free_port()}"  # neither gets as far as calling the server

    async def never(version: int):
        raise AssertionError("nothing is evaluated here")

    async def scenario() -> None:
        decisions = DeploymentLog(config, stack.bootstrap_servers, clickhouse)
        await decisions.start()
        follower = DeploymentFollower(config, stack.bootstrap_servers)
        stop = asyncio.Event()
        following = asyncio.create_task(follower.run(stop))

        said: dict[str, set[int]] = {}  # instance -> the times it announced itself

        def announced(role: str, live: bool = True):
            now = time.time_ns() // 1000
            for a in follower.announcements.values():
                said.setdefault(a.instance, set()).add(a.at_us)
            return [a for a in follower.announcements.values()
                    if a.model == name and a.role == role and a.live(now) == live]

        def running(role: str) -> bool:
            """Renewed once: past its start-up check (two starting at once may both refuse)."""
            return any(len(said.get(a.instance, ())) >= 2 for a in announced(role))

        try:
            gate_stop = asyncio.Event()
            gate = asyncio.create_task(Gate(gated, stack.bootstrap_servers, name, evaluate=never, warehouse=clickhouse,
                                            deployments=decisions, server_url=server_url).run(gate_stop))
            await wait_until(lambda: running("gate"), 30, "the gate running")
            with pytest.raises(GateDisagreement, match=r"runs with deploy\.gate = false .* but the gate"):
                await asyncio.wait_for(HotSwapper(config, stack.bootstrap_servers, server_url, name).run(
                    asyncio.Event()), 60)
            refused = await asyncio.to_thread(agentstream_cli, config, stack, "hotswap", "--server", server_url,
                                              "--model", name)
            why = refused.stderr.strip().splitlines()[-1]  # one line says why
            assert refused.returncode == 1
            assert why.startswith(f"error: hot swap for {name} runs with deploy.gate = false")
            gate_stop.set()
            await gate
            await wait_until(lambda: announced("gate", live=False) and not announced("gate"), 30,
                             "the gate's announcement withdrawn")

            swap_stop = asyncio.Event()
            swapper = asyncio.create_task(HotSwapper(config, stack.bootstrap_servers, server_url, name).run(swap_stop))
            await wait_until(lambda: running("hotswap"), 30, "hot swap running")
            with pytest.raises(GateDisagreement, match=r"restart hot swap with deploy\.gate = true"):
                await asyncio.wait_for(Gate(gated, stack.bootstrap_servers, name, evaluate=never, warehouse=clickhouse,
                                            deployments=decisions, server_url=server_url).run(asyncio.Event()), 60)
            assert not swapper.done()  # the one that ran first keeps running
            swap_stop.set()
            await swapper
        finally:
            stop.set()
            await following
            await decisions.stop()

    asyncio.run(scenario())


def agentstream_cli(config, stack, *args: str) -> subprocess.CompletedProcess:
    """``python -m agentstream ARGS`` against the test broker and ClickHouse, with the test's topics and database."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
    env.update(KAFKA_BOOTSTRAP_SERVERS=stack.bootstrap_servers, CLICKHOUSE_URL=stack.clickhouse_url,
               CLICKHOUSE_DATABASE=config.clickhouse.database, AGENTSTREAM_TOPIC_PREFIX=config.topics.prefix)
    return subprocess.run([sys.executable, "-m", "agentstream", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_an_evaluation_that_cannot_run_rejects_the_candidate_as_failed_not_as_scored(
        lora_setup, stack, publisher, clickhouse, tmp_path):
    """The evaluation goes through a proxy that is down: every call fails, and no candidate is judged on that."""
    import json

    from agentstream.deploy.gate import Gate
    from agentstream.evaluation import task_evaluator

    base, name, store = lora_setup
    task_file = tmp_path / "eval.jsonl"
    task_file.write_text("\n".join(json.dumps({"id": f"t{n}", "prompt": f"Count to {n}.", "expected": "x",
                                               "model": name}) for n in range(4)))
    gated = replace(base, deploy=replace(base.deploy, gate=True, eval_agent=EXACT_AGENT,
                                         eval_tasks=str(task_file)))
    dead_proxy = f"http://127.0.0.1:{free_port()}"

    async def scenario() -> None:
        server_runner, server_url = await serve_app(create_app(load_model("tiny"), served_model_names=(name,),
                                                               contract=Contract.VLLM))
        decisions = DeploymentLog(gated, stack.bootstrap_servers, clickhouse)
        await decisions.start()
        seen = []
        follower = DeploymentFollower(gated, stack.bootstrap_servers, on_decision=seen.append)
        stop = asyncio.Event()
        background = [asyncio.create_task(follower.run(stop)), asyncio.create_task(
            HotSwapper(gated, stack.bootstrap_servers, server_url, name, deployments=decisions).run(stop)),
            asyncio.create_task(Gate(gated, stack.bootstrap_servers, name,
                                     evaluate=task_evaluator(gated, dead_proxy, name, publisher), warehouse=clickhouse,
                                     deployments=decisions, server_url=server_url, poll_s=0.5).run(stop))]
        try:
            await asyncio.wait_for(follower.ready.wait(), 20)
            await publish(gated, stack.bootstrap_servers, lora_checkpoint(gated, broken=False), 1, store)
            rejected = await wait_until(lambda: next((d for d in seen if d.version == 1 and d.action == "REJECTED"),
                                                     None), 120, "v1 rejected")
        finally:
            stop.set()
            await asyncio.gather(*background)
            await decisions.stop()
            await server_runner.cleanup()
        assert rejected.reason.startswith("evaluation failed: ") and "failed 3 times" in rejected.reason
        assert rejected.candidate_score is None and rejected.routing.stable_version == 0
        assert [str(d.action) for d in seen if d.version == 1] == ["CANDIDATE", "REJECTED"]

    asyncio.run(scenario())


def test_a_decision_recorded_while_clickhouse_is_away_waits_for_it_instead_of_crashing(topics_config, stack,
                                                                                       tmp_path, caplog):
    """Hot swap recorded a promotion while ClickHouse restarted (make chaos): the insert failed and hot swap exited."""
    from agentstream.infra.clickhouse import connect, migrate
    from agentstream.infra.processes import wait_for_port

    asyncio.run(create_topics(topics_config, stack.bootstrap_servers))
    port = free_port()
    command = [sys.executable, "-m", "agentstream.stack.chserver", "--port", str(port), "--data-dir",
               str(tmp_path / "clickhouse")]

    def start_clickhouse() -> subprocess.Popen:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port("127.0.0.1", port, 30, process)
        return process

    database = topics_config.clickhouse.database
    clickhouse = start_clickhouse()
    client = connect(topics_config.clickhouse, f"http://127.0.0.1:{port}")
    migrate(client, database)
    client = connect(topics_config.clickhouse, f"http://127.0.0.1:{port}", database=database)
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    clickhouse.kill()
    clickhouse.wait()

    async def record_while_away() -> float:
        log = DeploymentLog(topics_config, stack.bootstrap_servers, client)
        await log.start()
        try:
            recording = asyncio.create_task(log.record(decide(Routing(name), 3, Action.PROMOTED, "hotswap",
                                                              "while ClickHouse restarts", stable_version=3)))
            await asyncio.sleep(2)
            assert not recording.done(), "it waits for ClickHouse rather than failing"
            nonlocal clickhouse
            clickhouse = await asyncio.to_thread(start_clickhouse)
            started = time.monotonic()
            await asyncio.wait_for(recording, 30)
            return time.monotonic() - started
        finally:
            await log.stop()

    try:
        caplog.set_level("WARNING", logger="agentstream.deployments")
        asyncio.run(record_while_away())
        rows = client.query("SELECT version, action FROM deployments FINAL WHERE model = {m:String}",
                            parameters={"m": name}).result_rows
        assert rows == [(3, "PROMOTED")]
        messages = [record.getMessage() for record in caplog.records]
        assert any("ClickHouse unreachable" in message for message in messages)
        assert any("ClickHouse is back" in message for message in messages)
    finally:
        client.close()
        clickhouse.terminate()
        clickhouse.wait()


def test_the_proxys_follower_knows_each_model_from_its_newest_decision_not_the_whole_history(topics_config, stack):
    """A restarted proxy reads the deployments history newest first: a busy model's 300 decisions are not replayed."""
    from aiokafka import AIOKafkaProducer

    from agentstream.deploy.deployments import Announcement, read_routes
    from agentstream.infra.kafka import client_options
    from agentstream.schemas import ANNOUNCEMENT, AvroCodec

    asyncio.run(create_topics(topics_config, stack.bootstrap_servers))
    busy, quiet = f"busy-{uuid.uuid4().hex[:6]}", f"quiet-{uuid.uuid4().hex[:6]}"
    said = [Announcement(busy, "gate", True, "gate-1", at_us, 20.0) for at_us in (1, 2)]

    async def history() -> None:
        log = DeploymentLog(topics_config, stack.bootstrap_servers)
        producer = AIOKafkaProducer(**client_options(topics_config.kafka, stack.bootstrap_servers))
        await log.start()
        await producer.start()
        topic, codec = topic_name(topics_config.topics, "deployments"), AvroCodec()
        key = f"announce/gate/{busy}/gate-1".encode()  # the topic is compacted: Kafka refuses a record without a key
        try:
            await producer.send_and_wait(topic, codec.encode(ANNOUNCEMENT, said[0].record()), key=key, partition=0)
            await log.record(decide(Routing(quiet), 1, Action.PROMOTED, "person", "once", stable_version=1))
            for version in range(1, 301):
                await log.record(decide(Routing(busy), version, Action.PROMOTED, "hotswap", "step",
                                        stable_version=version))
                if version == 150:
                    await producer.send_and_wait(topic, codec.encode(ANNOUNCEMENT, said[1].record()), key=key,
                                                 partition=0)
        finally:
            await producer.stop()
            await log.stop()

    asyncio.run(history())

    async def follow() -> None:
        seen = []
        follower = DeploymentFollower(topics_config, stack.bootstrap_servers, on_decision=seen.append,
                                      newest_first=True)
        stop = asyncio.Event()
        following = asyncio.create_task(follower.run(stop))
        try:
            await asyncio.wait_for(follower.current(busy), 20)
            assert follower.routing(busy).stable_version == 300
            await asyncio.wait_for(follower.current(quiet), 20)  # its one decision is the topic's oldest but one
            assert follower.routing(quiet).stable_version == 1
            await asyncio.wait_for(follower.ready.wait(), 20)
            assert [d.version for d in seen if d.model == busy] == [300]  # read newest first: one, not 300
            assert follower.announcements["gate-1"].at_us == 2
            assert {m: follower.routing(m) for m in (busy, quiet)} == {
                m: r for m, r in (await read_routes(topics_config, stack.bootstrap_servers)).items()
                if m in (busy, quiet)}

            log = DeploymentLog(topics_config, stack.bootstrap_servers)
            await log.start()
            try:  # and what comes after is read as it comes
                await log.record(decide(follower.routing(busy), 301, Action.PROMOTED, "hotswap", "step",
                                        stable_version=301))
            finally:
                await log.stop()
            await wait_until(lambda: follower.routing(busy).stable_version == 301, what="v301 read")
            assert [d.version for d in seen if d.model == busy] == [300, 301]
        finally:
            stop.set()
            await following

    asyncio.run(follow())

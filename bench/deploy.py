"""How long a checkpoint takes to reach all traffic, and whether any user request fails on the way.

A private stack, a streams worker, the dev model server with the tiny model in ``--contract
vllm`` mode, hot swap, the proxy following deployments, and users calling through the proxy
at a steady pace (each rollout rewarded on the spot). Checkpoints (LoRA adapters equal to the
base model, so they pass) are announced one after another:

- without the gate, ``promotion_seconds`` is checkpoint written -> promoted (hot swap loaded it);
- with the gate, candidate announced -> promoted, split into the evaluation's part and the
  canary's (whose minimum window is configured: it is reported next to the figure).

``swap_failed_requests`` counts user requests that failed over the whole run (target 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path

from agentstream.deploy.deployments import Decision, DeploymentFollower, DeploymentLog
from agentstream.deploy.gate import Gate
from agentstream.evaluation import task_evaluator
from agentstream.infra.clickhouse import connect
from agentstream.infra.config import Config, TrainerConfig
from agentstream.infra.kafka import create_topics
from agentstream.infra.processes import free_port
from agentstream.models import load_model
from agentstream.pipeline.proxy.server import LLMProxy, serve_proxy
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.serving.app import create_app
from agentstream.serving.hotswap import HotSwapper
from agentstream.serving.protocol import Contract
from agentstream.stack.control import Endpoints
from agentstream.trainer.checkpoint_writer import checkpoint_name, open_store, read_manifest
from bench.common import emit, private_stack
from bench.streams import start_worker, wait_ready
from tests.support.deploy_scenario import (
    EXACT_AGENT,
    Users,
    greedy_tasks,
    lora_checkpoint,
    publish,
    serve_app,
    wait_until,
)

PROMPTS = [f"Say something about the number {n}." for n in range(8)]


async def run(config: Config, endpoints: Endpoints, workdir: Path, promotions: int, gated: bool) -> None:
    name = f"tiny-{uuid.uuid4().hex[:6]}"
    config = replace(config, trainer=TrainerConfig(model="tiny", model_name=name, device="cpu", threads=1, lora=True,
                                           lora_r=4, lora_alpha=16))
    client = connect(config.clickhouse, endpoints.clickhouse_url, database=config.clickhouse.database)
    server_runner, server_url = await serve_app(create_app(load_model("tiny"), served_model_names=(name,),
                                                           contract=Contract.VLLM))
    tasks = await greedy_tasks(server_url, name, PROMPTS)
    (workdir / "eval.jsonl").write_text("\n".join(json.dumps(t) for t in tasks))
    config = replace(config, deploy=replace(config.deploy, gate=gated, eval_agent=EXACT_AGENT,
                                            eval_tasks=str(workdir / "eval.jsonl"), canary_share=0.5,
                                            canary_min_s=10.0, canary_min_rollouts=10, canary_max_s=120.0))
    decisions: list[Decision] = []
    stop, users_stop = asyncio.Event(), asyncio.Event()
    log = DeploymentLog(config, endpoints.bootstrap_servers, client)
    await log.start()
    follower = DeploymentFollower(config, endpoints.bootstrap_servers, on_decision=decisions.append)
    background = [asyncio.create_task(follower.run(stop)), asyncio.create_task(
        HotSwapper(config, endpoints.bootstrap_servers, server_url, name, deployments=log).run(stop))]
    store = open_store(str(workdir / "checkpoints"))
    with SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=workdir / "journal") as publisher:
        proxy_runner = await serve_proxy(LLMProxy(server_url, publisher, deployments=follower), "127.0.0.1",
                                         port := free_port())
        proxy_url = f"http://127.0.0.1:{port}"
        if gated:
            background.append(asyncio.create_task(Gate(
                config, endpoints.bootstrap_servers, name, evaluate=task_evaluator(config, proxy_url, name, publisher),
                warehouse=client, deployments=log, server_url=server_url, poll_s=0.5).run(stop)))
        users = Users(proxy_url, publisher, tasks)
        background.append(asyncio.create_task(users.run(users_stop)))
        await asyncio.wait_for(follower.ready.wait(), 30)
        durations, evaluations, canaries = [], [], []
        try:
            for version in range(1, promotions + 1):
                policy = lora_checkpoint(config, broken=False)
                await publish(config, endpoints.bootstrap_servers, policy, version, store)
                promoted = await wait_until(lambda v=version: next(
                    (d for d in decisions if d.version == v and d.action == "PROMOTED"), None), 300,
                    f"v{version} promoted")
                if gated:
                    mine = {str(d.action): d.at_us for d in decisions if d.version == version}
                    evaluations.append((mine["CANARY"] - mine["CANDIDATE"]) / 1e6)
                    canaries.append((promoted.at_us - mine["CANARY"]) / 1e6)
                    durations.append((promoted.at_us - mine["CANDIDATE"]) / 1e6)
                else:
                    created = store_created_us(store, name, version)
                    durations.append((promoted.at_us - created) / 1e6)
        finally:
            users_stop.set()
            stop.set()
            await asyncio.gather(*background)
            await proxy_runner.cleanup()
            await log.stop()
            await server_runner.cleanup()
            client.close()
    mode = "gate" if gated else "no_gate"
    extra = {"mode": mode, "promotions": promotions, "max": round(max(durations), 3)}
    if gated:
        extra.update(evaluation_s=round(statistics.median(evaluations), 3),
                     canary_s=round(statistics.median(canaries), 3), canary_min_s=config.deploy.canary_min_s,
                     canary_share=config.deploy.canary_share,
                     eval_tasks=len(tasks))
    emit("deploy", "promotion_seconds", statistics.median(durations), "s", **extra)
    emit("deploy", "swap_failed_requests", len(users.failed), "requests", mode=mode,
         requests=len(users.served) + len(users.failed), errors=users.failed[:3])


def store_created_us(store, model: str, version: int) -> int:
    return read_manifest(store, checkpoint_name(model, version)).created_at_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--promotions", type=int, default=3, help="Checkpoints to take to all traffic, per mode.")
    args = parser.parse_args()
    with private_stack() as (config, endpoints):
        for gated in (False, True):
            with tempfile.TemporaryDirectory(prefix="agentstream-bench-deploy-") as workdir:
                prefix = f"bench-deploy-{int(gated)}."
                mode_config = replace(config, topics=replace(config.topics, prefix=prefix))
                asyncio.run(create_topics(mode_config, endpoints.bootstrap_servers))
                env = {k: v for k, v in os.environ.items()
                       if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
                env.update({"KAFKA_BOOTSTRAP_SERVERS": endpoints.bootstrap_servers,
                            "CLICKHOUSE_URL": endpoints.clickhouse_url, "AGENTSTREAM_HOME": workdir,
                            "AGENTSTREAM_TOPIC_PREFIX": prefix})
                log_path = Path(workdir) / "streams.log"
                worker = start_worker(env, log_path)
                try:
                    wait_ready(worker, log_path)
                    asyncio.run(run(mode_config, endpoints, Path(workdir), args.promotions, gated))
                finally:
                    worker.terminate()
                    worker.wait(30)


if __name__ == "__main__":
    main()

"""The `agentstream gate` process: the promotion gate of one trained model."""

from __future__ import annotations

import asyncio
import logging

import uvloop

from deploy.deployments import DeploymentLog
from deploy.gate import Evaluate, Gate
from infra.clickhouse import migrate, wait_for_clickhouse
from infra.config import Config
from infra.grace import until_signalled


def run_gate(config: Config, bootstrap_servers: str, clickhouse_url: str, model_name: str, server_url: str, *,
             evaluate: Evaluate, proxy_url: str) -> None:
    """Evaluate each new checkpoint of ``model_name`` with ``evaluate``, canary it, promote or roll back, until SIGTERM.

    ``proxy_url`` is the proxy the evaluation runs through, named in the start-up line.
    """
    for name in ("agentstream.gate", "agentstream.deployments"):
        logging.getLogger(name).setLevel(logging.INFO)
    client = wait_for_clickhouse(config.clickhouse, clickhouse_url, timeout_s=30)
    migrate(client, config.clickhouse.database)

    async def serve() -> None:
        deployments = DeploymentLog(config, bootstrap_servers, client)
        await deployments.start()
        gate = Gate(config, bootstrap_servers, model_name, evaluate=evaluate, warehouse=client,
                    deployments=deployments, server_url=server_url)
        stop = asyncio.Event()
        watcher = asyncio.create_task(until_signalled(stop))
        print(f"gate: checkpoints of {model_name} -> evaluation through {proxy_url} -> canary "
              f"({config.deploy.canary_share:.0%}) -> promotion", flush=True)
        try:
            await gate.run(stop)
        finally:
            watcher.cancel()
            await deployments.stop()

    try:
        uvloop.run(serve())
    finally:
        client.close()

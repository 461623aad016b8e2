"""The `agentstream hotswap` process: keeps a model server holding the deployed versions of one trained model."""

from __future__ import annotations

import asyncio
import logging

import uvloop

from deploy.deployments import DeploymentLog
from infra.clickhouse import migrate, wait_for_clickhouse
from infra.config import Config
from infra.grace import until_signalled
from serving.hotswap import HotSwapper


def run_hotswap(config: Config, bootstrap_servers: str, clickhouse_url: str, server_url: str, model_name: str, *,
                verify: bool = True) -> None:
    """Load each version deployed for ``model_name`` into the server at ``server_url`` until SIGTERM or SIGINT."""
    logging.getLogger("agentstream.hotswap").setLevel(logging.INFO)
    logging.getLogger("agentstream.deployments").setLevel(logging.INFO)
    client = wait_for_clickhouse(config.clickhouse, clickhouse_url, timeout_s=30)
    migrate(client, config.clickhouse.database)

    async def serve() -> None:
        deployments = DeploymentLog(config, bootstrap_servers, client)
        await deployments.start()
        swapper = HotSwapper(config, bootstrap_servers, server_url, model_name, verify=verify,
                             deployments=deployments,
                             on_swap=lambda swap: print(f"{swap.model} v{swap.version} ({swap.format}) loaded "
                                                        f"as {swap.served_name}", flush=True))
        stop = asyncio.Event()
        watcher = asyncio.create_task(until_signalled(stop))
        mode = "the gate decides what serves" if config.deploy.gate else "no gate: each new checkpoint is promoted"
        print(f"hot swap: checkpoints of {model_name} -> {server_url} ({mode})", flush=True)
        try:
            await swapper.run(stop)
        finally:
            watcher.cancel()
            await deployments.stop()

    try:
        uvloop.run(serve())
    finally:
        client.close()

"""The `agentstream hotswap` process: keeps a model server holding the deployed versions of one trained model."""

from __future__ import annotations

import asyncio
import logging

from clickhouse_connect.driver.client import Client

from deploy.deployments import DeploymentLog
from deploy.service import run_with_deployment_log
from infra.config import Config
from serving.hotswap import HotSwapper


def run_hotswap(config: Config, bootstrap_servers: str, clickhouse_url: str, server_url: str, model_name: str, *,
                verify: bool = True) -> None:
    """Load each version deployed for ``model_name`` into the server at ``server_url`` until SIGTERM or SIGINT."""
    logging.getLogger("agentstream.hotswap").setLevel(logging.INFO)
    logging.getLogger("agentstream.deployments").setLevel(logging.INFO)

    async def hot_swap(deployments: DeploymentLog, client: Client, stop: asyncio.Event) -> None:
        swapper = HotSwapper(config, bootstrap_servers, server_url, model_name, verify=verify,
                             deployments=deployments,
                             on_swap=lambda swap: print(f"{swap.model} v{swap.version} ({swap.format}) loaded "
                                                        f"as {swap.served_name}", flush=True))
        mode = "the gate decides what serves" if config.deploy.gate else "no gate: each new checkpoint is promoted"
        print(f"hot swap: checkpoints of {model_name} -> {server_url} ({mode})", flush=True)
        await swapper.run(stop)

    run_with_deployment_log(config, bootstrap_servers, clickhouse_url, hot_swap)

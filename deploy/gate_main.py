"""The `agentstream gate` process: the promotion gate of one trained model."""

from __future__ import annotations

import asyncio
import logging

from clickhouse_connect.driver.client import Client

from agentstream.deploy.deployments import DeploymentLog
from agentstream.deploy.gate import Evaluate, Gate
from agentstream.deploy.service import run_with_deployment_log
from agentstream.infra.config import Config


def run_gate(config: Config, bootstrap_servers: str, clickhouse_url: str, model_name: str, server_url: str, *,
             evaluate: Evaluate, proxy_url: str) -> None:
    """Evaluate each new checkpoint of ``model_name`` with ``evaluate``, canary it, promote or roll back, until SIGTERM.

    ``proxy_url`` is the proxy the evaluation runs through, named in the start-up line.
    """
    for name in ("agentstream.gate", "agentstream.deployments"):
        logging.getLogger(name).setLevel(logging.INFO)

    async def gate(deployments: DeploymentLog, client: Client, stop: asyncio.Event) -> None:
        print(f"gate: checkpoints of {model_name} -> evaluation through {proxy_url} -> canary "
              f"({config.deploy.canary_share:.0%}) -> promotion", flush=True)
        await Gate(config, bootstrap_servers, model_name, evaluate=evaluate, warehouse=client,
                   deployments=deployments, server_url=server_url).run(stop)

    run_with_deployment_log(config, bootstrap_servers, clickhouse_url, gate)

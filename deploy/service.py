"""A process that follows the deployments log until SIGTERM or SIGINT: the shared frame of the gate and hot swap."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import uvloop
from clickhouse_connect.driver.client import Client

from agentstream.deploy.deployments import DeploymentLog
from agentstream.infra.clickhouse import migrate, wait_for_clickhouse
from agentstream.infra.config import Config
from agentstream.infra.grace import until_signalled
from agentstream.infra.kafka import client_options, named_refusals

Body = Callable[[DeploymentLog, Client, asyncio.Event], Awaitable[None]]
"""What the process does, given the started log, the ClickHouse client and the event set on a signal."""


def run_with_deployment_log(config: Config, bootstrap_servers: str, clickhouse_url: str, body: Body) -> None:
    """Migrate ClickHouse, start the deployments log, and run ``body`` until it returns or a signal stops it.

    A refusal by a secured cluster (login, ACL) ends the process with KafkaAccessDenied or KafkaAuthenticationFailed.
    """
    client = wait_for_clickhouse(config.clickhouse, clickhouse_url, timeout_s=30)
    migrate(client, config.clickhouse.database)

    async def serve() -> None:
        deployments = DeploymentLog(config, bootstrap_servers, client)
        async with named_refusals(client_options(config.kafka, bootstrap_servers), "following deployments"):
            await deployments.start()
            stop = asyncio.Event()
            watcher = asyncio.create_task(until_signalled(stop))
            try:
                await body(deployments, client, stop)
            finally:
                watcher.cancel()
                await deployments.stop()

    try:
        uvloop.run(serve())
    finally:
        client.close()

"""The `agentstream hotswap` process: keeps model servers holding the deployed versions of one trained model."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from clickhouse_connect.driver.client import Client

from agentstream.deploy.deployments import Decision, DeploymentLog
from agentstream.deploy.service import run_with_deployment_log
from agentstream.infra.config import Config
from agentstream.serving.hotswap import HotSwapper, Swap


def fleet_swappers(config: Config, bootstrap_servers: str, server_urls: Sequence[str], model_name: str, *,
                   deployments: DeploymentLog | None, verify: bool = True,
                   on_swap: Callable[[str, Swap], None] | None = None) -> list[HotSwapper]:
    """One hot swap per server, each reconciling its own server; without a gate the first to load promotes."""
    promotions: dict[int, Decision] = {}

    def swapped(url: str) -> Callable[[Swap], None] | None:
        return None if on_swap is None else (lambda swap: on_swap(url, swap))

    return [HotSwapper(config, bootstrap_servers, url, model_name, verify=verify, deployments=deployments,
                       on_swap=swapped(url), promotions=promotions) for url in server_urls]


async def run_fleet(swappers: Sequence[HotSwapper], stop: asyncio.Event) -> None:
    """Run every hot swap until ``stop``; one that fails stops the others and its error is raised as it is (a
    refusal such as DeploymentError reaches the CLI by its name, not wrapped in an ExceptionGroup)."""
    try:
        async with asyncio.TaskGroup() as group:
            for swapper in swappers:
                group.create_task(swapper.run(stop))
    except ExceptionGroup as failed:
        first, *others = failed.exceptions
        for other in others:
            logging.getLogger("agentstream.hotswap").error("another hot swap failed too: %s", other)
        raise first from None


def run_hotswap(config: Config, bootstrap_servers: str, clickhouse_url: str, server_url: str | Sequence[str],
                model_name: str, *, verify: bool = True) -> None:
    """Load each version deployed for ``model_name`` into the server(s) at ``server_url`` until SIGTERM or SIGINT."""
    logging.getLogger("agentstream.hotswap").setLevel(logging.INFO)
    logging.getLogger("agentstream.deployments").setLevel(logging.INFO)
    urls = [server_url] if isinstance(server_url, str) else list(server_url)

    async def hot_swap(deployments: DeploymentLog, client: Client, stop: asyncio.Event) -> None:
        several = len(urls) > 1
        swappers = fleet_swappers(
            config, bootstrap_servers, urls, model_name, deployments=deployments, verify=verify,
            on_swap=lambda url, swap: print(f"{swap.model} v{swap.version} ({swap.format}) loaded as "
                                            f"{swap.served_name}" + (f" on {url}" if several else ""), flush=True))
        mode = "the gate decides what serves" if config.deploy.gate else "no gate: each new checkpoint is promoted"
        print(f"hot swap: checkpoints of {model_name} -> {', '.join(urls)} ({mode})", flush=True)
        await run_fleet(swappers, stop)

    run_with_deployment_log(config, bootstrap_servers, clickhouse_url, hot_swap)

"""The `agentstream train-worker` process: one trainer of one model, from the transitions topic to checkpoints."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

import uvloop

from infra.clickhouse import migrate, wait_for_clickhouse
from infra.config import Config
from infra.grace import ShutdownDeadline, until_signalled
from infra.kafka import create_topics
from trainer.metrics import MetricsWriter
from trainer.worker import Rebase, TrainerWorker


def run_train_worker(config: Config, bootstrap_servers: str, clickhouse_url: str, *, max_steps: int | None = None,
                     rebase: Callable[[str, int], Rebase] | None = None) -> None:
    """Train ``trainer.model`` from the transitions topic until SIGTERM, SIGINT or ``max_steps``, writing checkpoints.

    ``rebase`` is TrainerWorker's: the trainer does not import ``deploy``, so its caller passes it.
    """
    database = config.clickhouse.database
    client = wait_for_clickhouse(config.clickhouse, clickhouse_url, timeout_s=30)
    migrate(client, database)

    async def serve() -> None:
        await create_topics(config, bootstrap_servers)
        worker = TrainerWorker(config, bootstrap_servers, metrics=MetricsWriter(client, database),
                               progress=partial(print, flush=True), rebase=rebase)
        stop = asyncio.Event()
        deadline = ShutdownDeadline("trainer", config.trainer.shutdown_grace_s, worker.unfinished)
        watcher = asyncio.create_task(until_signalled(stop, deadline))
        summary = await worker.run(stop, max_steps)
        watcher.cancel()
        deadline.disarm()
        print(f"trained {summary.steps} steps on {summary.transitions} transitions ({summary.tokens} tokens), "
              f"{summary.checkpoints} checkpoints; now at version {worker.version}", flush=True)

    try:
        uvloop.run(serve())
    finally:
        client.close()

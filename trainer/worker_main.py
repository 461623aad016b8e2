"""The `agentstream train-worker` process: one trainer of one model, from the transitions topic to checkpoints."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import uvloop

from agentstream.infra.clickhouse import migrate, wait_for_clickhouse
from agentstream.infra.config import Config
from agentstream.infra.grace import ShutdownDeadline, until_signalled
from agentstream.infra.kafka import client_options, create_topics, named_refusals
from agentstream.trainer.distributed import Group, Ranks, join, leave, rank_config
from agentstream.trainer.metrics import MetricsWriter
from agentstream.trainer.policy import build_policy
from agentstream.trainer.worker import Rebase, TrainerWorker


def run_train_worker(config: Config, bootstrap_servers: str, clickhouse_url: str, *, max_steps: int | None = None,
                     rebase: Callable[[str, int], Rebase] | None = None, ranks: Ranks | None = None) -> None:
    """Train ``trainer.model`` from the transitions topic until SIGTERM, SIGINT or ``max_steps``, writing checkpoints.

    ``rebase`` is TrainerWorker's: the trainer does not import ``deploy``, so its caller passes it.
    With ``ranks`` (torchrun's), this process is rank 0 of the data-parallel trainer; the other
    ranks run ``run_train_follower``.
    """
    database = config.clickhouse.database
    client = wait_for_clickhouse(config.clickhouse, clickhouse_url, timeout_s=30)
    migrate(client, database)
    group = None
    if ranks is not None:
        config = replace(config, trainer=rank_config(config.trainer, ranks))
        backend = join(config.trainer, ranks)
        group = Group(build_policy(config.trainer), config.trainer, ranks)
        print(f"trainer: rank 0 of {ranks.world} ({backend}); the only one that reads Kafka and writes checkpoints",
              flush=True)

    async def serve() -> None:
        async with named_refusals(client_options(config.kafka, bootstrap_servers), f"training {config.trainer.model}"):
            await train()

    async def train() -> None:
        await create_topics(config, bootstrap_servers)
        worker = TrainerWorker(config, bootstrap_servers, metrics=MetricsWriter(client, database),
                               progress=partial(print, flush=True), rebase=rebase,
                               policy=group.policy if group is not None else None, group=group)
        stop = asyncio.Event()
        deadline = ShutdownDeadline("trainer", config.trainer.shutdown_grace_s, worker.unfinished)
        watcher = asyncio.create_task(until_signalled(stop, deadline))
        summary = await worker.run(stop, max_steps)
        watcher.cancel()
        deadline.disarm()
        kept = (f" (supervised: {summary.below_threshold} below reward {config.trainer.supervised_min_reward:g} "
                "not trained)" if config.trainer.objective == "supervised" else "")
        print(f"trained {summary.steps} steps on {summary.transitions} transitions ({summary.tokens} tokens){kept}, "
              f"{summary.checkpoints} checkpoints; now at version {worker.version}", flush=True)
        if tracking := worker.tracker.summary():
            print(tracking, flush=True)

    try:
        uvloop.run(serve())
    finally:
        client.close()
        leave()


def run_train_follower(config: Config, ranks: Ranks) -> None:
    """A rank other than 0 of the data-parallel trainer: build the same model, then run rank 0's steps until it stops.

    It reads no topic and writes no checkpoint; if rank 0 or another rank dies, the next
    collective raises here and the process exits non-zero (torchrun restarts the group).
    SIGTERM and SIGINT are ignored: rank 0 stops the group once its last step (which needs every
    rank) and checkpoint are done; torchrun's SIGKILL still ends a group that does not stop.
    """
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    settings = rank_config(config.trainer, ranks)
    backend = join(settings, ranks)
    print(f"trainer: rank {ranks.rank} of {ranks.world} ({backend}), pid {os.getpid()}, follows rank 0", flush=True)
    try:
        steps = Group(build_policy(settings), settings, ranks).follow()
    finally:
        leave()
    print(f"trainer: rank {ranks.rank} of {ranks.world} ({backend}) took {steps} steps", flush=True)

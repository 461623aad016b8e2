"""The `agentstream run` process: one member of a runner pool, running an agent on tasks from the tasks topic."""

from __future__ import annotations

import asyncio

import uvloop

from agentstream.infra.config import AglConfig, Config
from agentstream.infra.grace import ShutdownDeadline, until_signalled
from agentstream.pipeline.publisher import process_publisher
from agentstream.pipeline.runner.pool import Runner, RunnerOptions
from agentstream.pipeline.sdk import set_sink


def run_runner(config: Config, bootstrap_servers: str, agent: str, options: RunnerOptions, *,
               agl: AglConfig | None = None, max_tasks: int | None = None) -> None:
    """Run ``agent`` (module:function) on tasks until SIGTERM, SIGINT or ``max_tasks`` rollouts, then say how many."""

    async def serve() -> None:
        with process_publisher(config, bootstrap_servers, "runner") as publisher:
            set_sink(publisher)
            runner = Runner(agent, config, bootstrap_servers, publisher, options, agl)
            stop = asyncio.Event()
            deadline = ShutdownDeadline("runner", config.runner.shutdown_grace_s, runner.unfinished)
            watcher = asyncio.create_task(until_signalled(stop, deadline))
            print(f"runner {options.worker_id}: {agent} x{options.concurrency} in group {options.group_id}",
                  flush=True)
            stats = await runner.run(stop, max_tasks)
            watcher.cancel()
            deadline.disarm()
            print(f"finished {stats.finished} rollouts: {stats.succeeded} succeeded, {stats.failed} failed, "
                  f"{stats.timed_out} timed out, {stats.retried} retried", flush=True)

    uvloop.run(serve())

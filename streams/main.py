"""The `agentstream streams` process: one stream-processing worker (spans to ClickHouse, trajectories, transitions)."""

from __future__ import annotations

import asyncio
import gc

import uvloop

from agentstream.infra.clickhouse import migrate, wait_for_clickhouse
from agentstream.infra.config import Config


def run_streams_worker(config: Config, bootstrap_servers: str, clickhouse_url: str, loglevel: str = "info") -> None:
    """Run one stream-processing worker until SIGTERM or SIGINT; run more processes to scale."""
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    # Imported once uvloop's policy is set, as before this function existed: faust and mode make loops.
    from agentstream.streams.app import create_app, named_crash, prepare_kafka, streams_worker

    client = wait_for_clickhouse(config.clickhouse, clickhouse_url, timeout_s=30)
    migrate(client, config.clickhouse.database)
    client.close()
    asyncio.run(prepare_kafka(config, bootstrap_servers))
    app = create_app(config, bootstrap_servers, clickhouse_url)
    # The worker makes a few container objects per span and keeps open rollouts' spans alive: with
    # the default thresholds the cycle collector ran hundreds of times a second over all of them (a
    # third of the completion work). Cycles are rare here: collect seldom, and never scan start-up's objects.
    # Rare is not never: the libraries leave about 800 unreachable cycles a minute at the soak's load, and
    # the count below took an hour to reach its threshold, so RSS crept 15 MB/h; a timer in the app runs
    # a full collection every CYCLE_COLLECTION_S instead.
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    worker = streams_worker(app, config, loglevel)
    try:
        worker.execute_from_commandline()
    except SystemExit:  # faust exits 1 after a crash and keeps the cause in crash_reason
        named = named_crash(config, bootstrap_servers, worker.crash_reason)
        if named is None:
            raise
        raise named from worker.crash_reason

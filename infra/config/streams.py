"""The [streams] section: how the stream processors batch, complete rollouts and wait for rewards."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamsConfig:
    """How stream processors batch, when rollouts count as complete, and how long online rollouts wait for rewards."""

    app_id: str = "agentstream-streams"
    batch_max_records: int = 10000
    batch_within_s: float = 0.05
    grace_s: float = 0.2
    idle_timeout_s: float = 30.0
    reward_expiry_s: float = 24 * 3600.0
    clickhouse_retry_max_s: float = 1.0  # the longest wait between retries: ClickHouse back = stored within ~1 s
    session_timeout_s: float = 3.0  # tansu holds a join about half of it: a restarted worker is back in ~4 s
    fetch_max_wait_ms: int = 50  # tansu answers a fetch only after this wait when it had nothing at first
    ingest_interval_s: float = 1.0  # span batches read meanwhile are inserted together
    store_interval_s: float = 1.0  # rollouts and transitions rows are written to ClickHouse this often
    shutdown_grace_s: float = 10.0  # after SIGTERM/SIGINT the worker exits within this, broker or not

"""A person's deployment decisions: what ``agentstream promote``/``rollback`` decide, and the recent decisions.

The CLI only parses the options, calls :func:`promote_by_hand`, :func:`roll_back_by_hand` and
:func:`recent_decisions` (and :func:`agentstream.deploy.deployments.read_routes`) and prints; the
decisions are recorded with :class:`agentstream.deploy.deployments.DeploymentLog` like the gate's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentstream.deploy.deployments import (
    Action,
    Decision,
    DeploymentError,
    DeploymentLog,
    Routing,
    decide,
    read_routes,
)
from agentstream.infra.clickhouse import ClickHouseError, connect, query_error
from agentstream.infra.config import Config
from agentstream.schemas.checkpoint import CHECKPOINT_COLUMNS, Checkpoint


def read_checkpoint(warehouse: Any, database: str, model: str, version: int) -> Checkpoint:
    """Version ``version`` of ``model`` as the checkpoints table knows it."""
    rows = warehouse.query(f"SELECT {', '.join(CHECKPOINT_COLUMNS)} FROM {database}.checkpoints FINAL "
                           "WHERE model = {model:String} AND version = {version:Int64}",
                           parameters={"model": model, "version": version}).result_rows
    if not rows:
        raise DeploymentError(f"model {model!r} has no checkpoint v{version} (see: agentstream sql "
                              f"\"SELECT version FROM checkpoints WHERE model = '{model}'\")")
    return Checkpoint.from_row(rows[0])


def promotion(routing: Routing, version: int, checkpoint: Checkpoint | None) -> Decision:
    """A person's promotion of ``version`` (0: the base model) to all traffic, ending any canary or candidate."""
    if version == 0 and routing.format == "full":
        raise DeploymentError("full-weight deployments cannot go back to the base model by promotion: "
                              "promote a checkpoint")
    return decide(routing, version, Action.PROMOTED, "manual", "promoted by hand (agentstream promote)",
                  stable_version=version, stable_uri=checkpoint.uri if checkpoint else "",
                  format=checkpoint.format if checkpoint else routing.format, canary_version=None, canary_share=0.0,
                  candidate_version=None)


def rollback(routing: Routing, previous: tuple[int, str] | None) -> Decision:
    """A person's rollback: end the canary if one runs, else put the version that served before the stable back."""
    if routing.canary_version is not None:
        return decide(routing, routing.canary_version, Action.ROLLED_BACK, "manual",
                      "canary ended by hand (agentstream rollback)", canary_version=None, canary_share=0.0)
    if previous is None:
        raise DeploymentError(f"{routing.model}: nothing to roll back to (no version served before "
                              f"v{routing.stable_version})")
    version, uri = previous
    return decide(routing, routing.stable_version, Action.ROLLED_BACK, "manual",
                  f"rolled back by hand to v{version} (agentstream rollback)", stable_version=version,
                  stable_uri=uri, candidate_version=None)


def previous_stable(warehouse: Any, database: str, routing: Routing) -> tuple[int, str] | None:
    """The stable version (and its URI) in force before the current one, from the decisions table.

    Before a model's first decision its base model served, so that is what a LoRA deployment
    goes back to when no earlier stable version is recorded.
    """
    rows = warehouse.query(
        f"SELECT stable_version, argMax(decision_id, decided_at) FROM {database}.deployments FINAL "
        "WHERE model = {model:String} AND stable_version != {current:Int64} "
        "GROUP BY stable_version ORDER BY max(decided_at) DESC LIMIT 1",
        parameters={"model": routing.model, "current": routing.stable_version}).result_rows
    if not rows:
        return (0, "") if routing.stable_version and routing.format == "lora" else None
    version = int(rows[0][0])
    if version == 0:
        return 0, ""
    return version, read_checkpoint(warehouse, database, routing.model, version).uri


async def record_decision(config: Config, bootstrap_servers: str, warehouse: Any, decision: Decision) -> None:
    """Write one decision to the deployments topic and table."""
    log_ = DeploymentLog(config, bootstrap_servers, warehouse)
    await log_.start()
    try:
        await log_.record(decision)
    finally:
        await log_.stop()


RECENT_DECISIONS_SQL = """
SELECT decided_at, model, version, action, decided_by, reason
FROM {database}.deployments FINAL
WHERE {model:String} = '' OR model = {model:String}
ORDER BY decided_at DESC
LIMIT {limit:UInt32}
"""


def promote_by_hand(config: Config, bootstrap_servers: str, clickhouse_url: str, model: str,
                    version: int) -> Decision:
    """``agentstream promote``: serve ``version`` of ``model`` (0: the base model) to all traffic, recorded."""
    warehouse = connect(config.clickhouse, clickhouse_url)
    try:
        routing = asyncio.run(read_routes(config, bootstrap_servers)).get(model, Routing(model))
        checkpoint = read_checkpoint(warehouse, config.clickhouse.database, model, version) if version else None
        decision = promotion(routing, version, checkpoint)
        asyncio.run(record_decision(config, bootstrap_servers, warehouse, decision))
    finally:
        warehouse.close()
    return decision


def roll_back_by_hand(config: Config, bootstrap_servers: str, clickhouse_url: str, model: str) -> Decision:
    """``agentstream rollback``: end ``model``'s canary, or serve the stable version before the current one again."""
    warehouse = connect(config.clickhouse, clickhouse_url)
    try:
        routing = asyncio.run(read_routes(config, bootstrap_servers)).get(model)
        if routing is None:
            raise DeploymentError(f"model {model!r} has no deployments: nothing to roll back")
        previous = None if routing.canary_version is not None else previous_stable(
            warehouse, config.clickhouse.database, routing)
        decision = rollback(routing, previous)
        asyncio.run(record_decision(config, bootstrap_servers, warehouse, decision))
    finally:
        warehouse.close()
    return decision


def recent_decisions(config: Config, clickhouse_url: str, model: str | None, limit: int) -> list[tuple[Any, ...]]:
    """The latest ``limit`` decisions (of ``model``, or of every model): decided_at, model, version, action, by, reason.

    A database `agentstream up` never migrated has no deployments table: the error says to run it.
    """
    database = config.clickhouse.database
    warehouse = connect(config.clickhouse, clickhouse_url, readonly=True)
    try:
        return [tuple(row) for row in warehouse.query(RECENT_DECISIONS_SQL.replace("{database}", database),
                                                      parameters={"model": model or "", "limit": limit}).result_rows]
    except Exception as error:  # clickhouse-connect raises several types; the server's text says why
        failed = query_error(error, f"cannot read {database}.deployments: ")
        if not failed.retriable:  # ClickHouse answered: most likely a database `agentstream up` never migrated
            failed = ClickHouseError(f"{failed} (run `agentstream up` to create the tables)")
        raise failed from None
    finally:
        warehouse.close()

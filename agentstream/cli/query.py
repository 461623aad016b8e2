"""Read-only commands over the traces in ClickHouse: ``sql``, ``report``, ``dataset export`` and ``dashboard``."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

import click

from agentstream.cli.common import command_config as _config
from agentstream.cli.common import render
from agentstream.infra.clickhouse import connect, query_error
from agentstream.stack.control import Stack


@click.command()
@click.argument("query", required=False)
@click.option("--file", "query_file", type=click.File("r"), help="Read the query from a file ('-' for stdin).")
@click.option("--format", "output_format", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
@click.option("--write", is_flag=True, help="Allow statements that change data (queries are read-only by default).")
@click.pass_context
def sql(ctx: click.Context, query: str | None, query_file, output_format: str, write: bool) -> None:
    """Run SQL against the configured ClickHouse (database defaults to the agentstream one)."""
    if query_file is not None:
        query = query_file.read()
    if not query:
        raise click.UsageError("give a QUERY or --file")
    config = _config(ctx)
    client = connect(config.clickhouse, Stack(config).endpoints().clickhouse_url,
                     database=config.clickhouse.database, readonly=not write)
    try:
        result = client.query(query)
    except Exception as error:  # clickhouse-connect raises several types; the server's text says why
        raise query_error(error) from None
    click.echo(render(result.column_names, result.result_rows, output_format), nl=False)


@click.command("report")
@click.option("--format", "output_format", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
@click.option("--agent", default=None, help="Only this agent's rollouts and spans.")
@click.option("--model", default=None, help="Only rows of this model (its LLM spans, rollouts and train steps).")
@click.option("--since", default=None, help="Only the last DURATION, e.g. 30m, 1h, 2d (default: all time).")
@click.option("--bucket", default="1m", show_default=True, help="Throughput bucket size, e.g. 30s, 1m, 1h.")
@click.option("--buckets", default=30, show_default=True, type=click.IntRange(1, 10_000),
              help="Throughput buckets shown, ending at the newest activity.")
@click.pass_context
def report_command(ctx: click.Context, output_format: str, agent: str | None, model: str | None, since: str | None,
                   bucket: str, buckets: int) -> None:
    """Analytics over the configured ClickHouse (read-only): reward by policy version, LLM tokens and latency,
    rollout status, training staleness, throughput, and spans by source (how many LLM spans have no token ids:
    those are analytics only, never trained on)."""
    from agentstream import report as analytics

    try:
        since_s = analytics.parse_duration(since) if since else 0
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--since") from None
    try:
        bucket_s = analytics.parse_duration(bucket)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--bucket") from None
    filters = analytics.ReportFilters(agent=agent or "", model=model or "", since_s=since_s, bucket_s=bucket_s,
                                      buckets=buckets)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # its retry warning; our error line says what failed
    config = _config(ctx)
    client = connect(config.clickhouse, Stack(config).endpoints().clickhouse_url,
                     database=config.clickhouse.database, readonly=True)
    try:
        sections = analytics.build_report(client, filters)
    finally:
        client.close()
    if output_format == "json":
        click.echo(analytics.render_json(sections), nl=False)
    elif output_format == "csv":
        click.echo(analytics.render_csv(sections), nl=False)
    else:
        analytics.print_tables(sections)


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A number option that must be finite (NaN would select nothing, silently)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} must be a finite number")
    return value


@click.group("dataset")
def dataset_group() -> None:
    """Datasets from the traces in ClickHouse, for Hugging Face datasets and offline training."""


@dataset_group.command("export")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--format", "file_format", type=click.Choice(["jsonl", "parquet"]), default=None,
              help="File format (default: from OUT's suffix: .jsonl, .jsonl.gz, .parquet).")
@click.option("--where", default=None, help="A SQL expression over the rollouts table's columns, run read-only.")
@click.option("--agent", "agents", multiple=True, help="Only this agent's rollouts (repeat for several).")
@click.option("--min-reward", type=float, default=None, callback=_finite,
              help="Only rollouts whose final reward is at least R.")
@click.option("--max-reward", type=float, default=None, callback=_finite,
              help="Only rollouts whose final reward is at most R.")
@click.option("--since", default=None, help="Only rollouts started at or after TIME (ISO 8601, or a duration: 2h).")
@click.option("--until", default=None, help="Only rollouts started before TIME (ISO 8601, or a duration ago).")
@click.option("--version", type=int, default=None, help="Only rollouts of policy version N (their newest version).")
@click.option("--min-version", type=int, default=None, help="Only rollouts of policy version N or later.")
@click.option("--max-version", type=int, default=None, help="Only rollouts of policy version N or earlier.")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="At most N rollouts (by rollout id).")
@click.option("--batch-rollouts", type=click.IntRange(min=1), default=500, show_default=True,
              help="Rollouts per page: one Parquet row group, and what memory holds at a time.")
@click.pass_context
def dataset_export(ctx: click.Context, out: Path, file_format: str | None, where: str | None, agents: tuple[str, ...],
                   min_reward: float | None, max_reward: float | None, since: str | None, until: str | None,
                   version: int | None, min_version: int | None, max_version: int | None, limit: int | None,
                   batch_rollouts: int) -> None:
    """Write the selected rollouts, one row each (conversation, LLM calls' token ids, training samples), to OUT as
    JSON Lines or Parquet that Hugging Face datasets loads; streamed page by page, renamed into place at the end."""
    from agentstream import dataset

    if version is not None and (min_version is not None or max_version is not None):
        raise click.UsageError("give --version or --min-version/--max-version, not both")
    times = {}
    for name, text in (("--since", since), ("--until", until)):
        try:
            times[name] = dataset.parse_time(text) if text else None
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint=name) from None
    filters = dataset.ExportFilters(
        where=where or "", agents=agents, min_reward=min_reward, max_reward=max_reward, since=times["--since"],
        until=times["--until"], min_version=version if version is not None else min_version,
        max_version=version if version is not None else max_version, limit=limit)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # its retry warning; our error line says what failed
    config = _config(ctx)
    client = connect(config.clickhouse, Stack(config).endpoints().clickhouse_url,
                     database=config.clickhouse.database, readonly=True)
    try:
        result = dataset.export(client, out, filters, format=file_format, batch_rollouts=batch_rollouts,
                                progress=lambda done: click.echo(dataset.progress_line(done), err=True))
    finally:
        client.close()
    click.echo(dataset.summary_line(result), err=True)


@click.command("dashboard")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback: only this machine).")
@click.option("--port", default=8765, show_default=True, type=int, help="Port to listen on (0: any free port).")
@click.option("--database", default=None, help="ClickHouse database to show (default: the configured one).")
@click.option("--no-kafka", is_flag=True, help="Do not read consumer lag and dead letters from Kafka.")
@click.pass_context
def dashboard_command(ctx: click.Context, host: str, port: int, database: str | None, no_kafka: bool) -> None:
    """A live web dashboard over ClickHouse (read-only): throughput, learning, LLM calls, rollouts."""
    from agentstream.dashboard.server import serve

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    try:
        asyncio.run(serve(config, endpoints.clickhouse_url, None if no_kafka else endpoints.bootstrap_servers,
                          host=host, port=port, database=database,
                          started=lambda url: click.echo(f"dashboard: {url}  (Ctrl-C stops it)")))
    except KeyboardInterrupt:  # how it stops: nothing to report
        pass


COMMANDS = [sql, report_command, dataset_group, dashboard_command]

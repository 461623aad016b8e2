"""The `agentstream` command line: the local stack, SQL over ClickHouse, and (later) runners and training."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from infra.clickhouse import ClickHouseError, connect, server_message
from infra.config import Config, ConfigError, describe, load_config
from infra.kafka import KafkaSetupError
from infra.processes import ServiceError
from infra.stack import Stack

KNOWN_ERRORS = (ConfigError, ServiceError, ClickHouseError, KafkaSetupError)


class AgentstreamGroup(click.Group):
    """A click group that turns our named errors into one clear line and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KNOWN_ERRORS as error:
            click.secho(f"error: {error}", fg="red", err=True)
            sys.exit(1)


@click.group(cls=AgentstreamGroup)
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="TOML config file (default: ./agentstream.toml if present, or $AGENTSTREAM_CONFIG).")
@click.pass_context
def main(ctx: click.Context, config_path: Path | None) -> None:
    """agentstream: reinforcement learning for any agent, streamed over Kafka."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("aiokafka", "clickhouse_connect"):  # their retry chatter; our errors say what failed
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    ctx.obj = config_path


def _config(ctx: click.Context) -> Config:
    return load_config(ctx.obj)


@main.command()
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for each service to answer.")
@click.pass_context
def up(ctx: click.Context, timeout: float) -> None:
    """Start the local broker and ClickHouse (unless external ones are configured), create topics and tables."""
    endpoints = Stack(_config(ctx)).up(timeout_s=timeout)
    click.echo(f"ready: KAFKA_BOOTSTRAP_SERVERS={endpoints.bootstrap_servers} CLICKHOUSE_URL={endpoints.clickhouse_url}")


@main.command()
@click.pass_context
def status(ctx: click.Context) -> None:
    """Show broker reachability, topics, consumer groups, ClickHouse version and table row counts."""
    config = _config(ctx)
    report = Stack(config).status()
    click.echo(f"kafka       {report.endpoints.bootstrap_servers}  "
               + ("reachable" if report.broker_reachable else f"UNREACHABLE ({report.broker_error})")
               + f"  [{report.services['broker']}]")
    for name, (partitions, messages) in report.topics.items():
        click.echo(f"  topic {name:<32} partitions {partitions:>3}  messages {messages:>10}")
    if report.broker_reachable:
        click.echo("  consumer groups: " + (", ".join(report.groups) if report.groups else "none"))
    click.echo(f"clickhouse  {report.endpoints.clickhouse_url}  "
               + (f"version {report.clickhouse_version}" if report.clickhouse_version
                  else f"UNREACHABLE ({report.clickhouse_error})")
               + f"  [{report.services['clickhouse']}]")
    for table, rows in report.tables.items():
        click.echo(f"  table {config.clickhouse.database}.{table:<24} rows {rows:>10}" if rows >= 0
                   else f"  table {config.clickhouse.database}.{table:<24} missing (run `agentstream up`)")
    if not (report.broker_reachable and report.clickhouse_version):
        sys.exit(1)


@main.command()
@click.pass_context
def down(ctx: click.Context) -> None:
    """Stop exactly the services `agentstream up` started from this state folder."""
    Stack(_config(ctx)).down()


@main.command()
@click.argument("query", required=False)
@click.option("--file", "query_file", type=click.File("r"), help="Read the query from a file ('-' for stdin).")
@click.option("--format", "output_format", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
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
    except Exception as error:
        raise ClickHouseError(server_message(error)) from None
    click.echo(render(result.column_names, result.result_rows, output_format), nl=False)


def render(columns, rows, output_format: str) -> str:
    """Rows as an aligned text table, CSV, or JSON lines."""
    if output_format == "json":
        return "".join(json.dumps(dict(zip(columns, row)), default=str) + "\n" for row in rows)
    if output_format == "csv":
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(columns)
        writer.writerows(rows)
        return buffer.getvalue()
    cells = [[str(c) for c in columns]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines) + f"\n({len(rows)} row{'s' if len(rows) != 1 else ''})\n"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


@main.command()
@click.pass_context
def demo(ctx: click.Context) -> None:
    """Run the demo: stack up, publish real spans through Kafka, query them in ClickHouse, stack down."""
    from pipeline.demo import run_demo

    run_demo(_config(ctx))


@main.command("config")
@click.pass_context
def show_config(ctx: click.Context) -> None:
    """Print the effective configuration (secrets masked)."""
    click.echo(json.dumps(describe(_config(ctx)), indent=2, default=str))

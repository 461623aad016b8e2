"""The one-command stack's commands: ``up``, ``status``, ``down``, ``config`` and ``kafka-acls``."""

from __future__ import annotations

import json
import sys

import click

from agentstream.cli.common import command_config as _config
from agentstream.infra.config import describe
from agentstream.stack.control import Stack


@click.command()
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for each service to answer.")
@click.pass_context
def up(ctx: click.Context, timeout: float) -> None:
    """Start the local broker and ClickHouse (unless external ones are configured), create topics and tables."""
    endpoints = Stack(_config(ctx)).up(timeout_s=timeout)
    click.echo(f"ready: KAFKA_BOOTSTRAP_SERVERS={endpoints.bootstrap_servers} "
               f"CLICKHOUSE_URL={endpoints.clickhouse_url}")


@click.command()
@click.pass_context
def status(ctx: click.Context) -> None:
    """Show broker reachability, topics, consumer groups, ClickHouse version and table row counts."""
    config = _config(ctx)
    report = Stack(config).status()
    if not report.broker_reachable and not report.clickhouse_version and report.nothing_running:
        click.echo(f"the stack is down (kafka {report.endpoints.bootstrap_servers} and clickhouse "
                   f"{report.endpoints.clickhouse_url} do not answer): start it with `agentstream up`")
        sys.exit(1)
    click.echo(f"kafka       {report.endpoints.bootstrap_servers}  "
               + ("reachable" if report.broker_reachable else f"UNREACHABLE ({report.broker_error})")
               + f"  [{report.services['broker']}]")
    if not config.kafka.external and config.stack.broker == "kafka":
        click.echo(f"  broker: Apache Kafka, data {config.stack.home.resolve() / 'kafka'}")
    if "objectstore" in report.services:
        held = "checkpoints" if config.stack.broker == "kafka" else "durable"
        click.echo(f"  storage: {held}, {Stack(config).broker_data}  [objectstore {report.services['objectstore']}]")
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
    if "schema-registry" in report.services:
        from agentstream.stack.registry_server.service import registry_url

        click.echo(f"schemas     {registry_url(config)}  [{report.services['schema-registry']}]")
    if not (report.broker_reachable and report.clickhouse_version):
        sys.exit(1)


@click.command()
@click.pass_context
def down(ctx: click.Context) -> None:
    """Stop exactly the services `agentstream up` started from this state folder."""
    Stack(_config(ctx)).down()


@click.command("kafka-acls")
@click.option("--bootstrap-server", default="<broker:9093>", show_default=True, help="The address the commands name.")
@click.option("--command-config", default=None, help="The admin client's properties file for kafka-acls.sh.")
@click.option("--user", "users", multiple=True, metavar="ROLE=NAME",
              help="The principal of a role (default: the role's name); repeat per role.")
@click.option("--runner-group", default="agentstream-runners", show_default=True, help="The runners' consumer group.")
@click.pass_context
def kafka_acls_command(ctx: click.Context, bootstrap_server: str, command_config: str | None, users: tuple[str, ...],
                       runner_group: str) -> None:
    """Print the kafka-acls.sh commands that grant each role (runner, proxy, collector, worker, trainer, hotswap)
    exactly the topics and groups it uses, under this configuration's topic prefix."""
    from agentstream.infra.acls import kafka_acls_commands

    named = dict(user.split("=", 1) for user in users if "=" in user)
    for line in kafka_acls_commands(_config(ctx), bootstrap_server, named, command_config, runner_group):
        click.echo(line)


@click.command("config")
@click.pass_context
def show_config(ctx: click.Context) -> None:
    """Print the effective configuration (secrets masked)."""
    click.echo(json.dumps(describe(_config(ctx)), indent=2, default=str))


COMMANDS = [up, status, down, show_config, kafka_acls_command]

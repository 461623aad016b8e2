"""``agentstream schema-registry``: serve the Schema Registry API, register the product's schemas, list subjects."""

from __future__ import annotations

import click

from agentstream.cli.common import command_config as _config
from agentstream.stack.registry_server.service import registry_client, registry_url


@click.group("schema-registry")
def schema_registry_command() -> None:
    """The Confluent Schema Registry API for agentstream's schemas (the stack's, or yours: [schema_registry] url)."""


@schema_registry_command.command("serve")
@click.option("--host", default=None, help="Listen address (default: [stack] host).")
@click.option("--port", default=None, type=int, help="Port (default: [schema_registry] port, 8081).")
@click.option("--topic", default=None, help="Kafka topic of the registry's log (default: <prefix>_schemas).")
@click.option("--ids", type=click.Choice(["fingerprint", "sequential"]), default=None,
              help="fingerprint: the ids agentstream's records carry; sequential: 1, 2, 3 as Confluent assigns.")
@click.option("--memory", is_flag=True, help="Keep the log in memory instead of Kafka (nothing survives a restart).")
@click.pass_context
def serve_command(ctx: click.Context, host: str | None, port: int | None, topic: str | None, ids: str | None,
                  memory: bool) -> None:
    """Serve the registry in the foreground on the configured Kafka (what `agentstream up` starts)."""
    from agentstream.stack.control import Stack
    from agentstream.stack.registry_server.__main__ import run

    config = _config(ctx)
    bootstrap = Stack(config).endpoints().bootstrap_servers
    run(config, bootstrap, host or config.stack.host, port or config.schema_registry.port, topic, ids, memory,
        announce=click.echo)


@schema_registry_command.command("register")
@click.pass_context
def register_command(ctx: click.Context) -> None:
    """Register every current agentstream schema (after the compatibility check) and print the ids in use."""
    from agentstream.infra.registry_client import RemoteRegistry, register_product_schemas

    config = _config(ctx)
    settings = config.schema_registry
    url = registry_url(config)
    registry = RemoteRegistry(registry_client(config), settings.compatibility)
    for subject, schema_id in register_product_schemas(registry).items():
        click.echo(f"{subject:<36} id {schema_id}")
    click.echo(f"registered in {url} ({settings.compatibility.upper()} checked)")


@schema_registry_command.command("subjects")
@click.pass_context
def subjects_command(ctx: click.Context) -> None:
    """List the registry's subjects with their latest version and id."""
    config = _config(ctx)
    client = registry_client(config)
    for subject in client.subjects():
        latest = client.latest(subject)
        if latest is not None:
            click.echo(f"{subject:<36} version {latest['version']:>3}  id {latest['id']}")

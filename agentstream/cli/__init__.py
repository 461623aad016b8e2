"""The `agentstream` command line: it parses options, resolves the configuration and calls what does the work.

A long-running process's `main` lives in the package of what it does (``pipeline/proxy/main.py``,
``trainer/worker_main.py``, ``deploy/gate_main.py``, ...); here it only gets its options. The
commands live in modules by area (``stack``, ``query``, ``serve``, ``training``, ``deployments``,
``schema_registry``); this module is the group that holds them.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from agentstream.cli import deployments, query, serve, stack, training
from agentstream.cli.schema_registry import schema_registry_command
from agentstream.infra.clickhouse import ClickHouseError
from agentstream.infra.config import ConfigError
from agentstream.infra.kafka import KafkaSetupError
from agentstream.infra.processes import ServiceError
from agentstream.infra.registry_client.errors import RegistryError, RegistryUnavailable
from agentstream.pipeline.runner.pool import AgentLoadError
from agentstream.pipeline.runner.tasks import TaskFileError

__all__ = ["main"]

KNOWN_ERRORS = (ConfigError, ServiceError, ClickHouseError, KafkaSetupError, AgentLoadError, TaskFileError,
                RegistryError, RegistryUnavailable)


class AgentstreamGroup(click.Group):
    """A click group that turns our named errors into one clear line and exit status 1.

    A Kafka error's line starts with its class (KafkaAccessDenied, KafkaAuthenticationFailed, SessionTimeoutRefused,
    ...): an operator's alert or search matches the kind of refusal without parsing the sentence.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KNOWN_ERRORS as error:
            kind = f"{type(error).__name__}: " if isinstance(error, KafkaSetupError) else ""
            click.secho(f"error: {kind}{error}", fg="red", err=True)
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


for _module in (stack, query, serve, training, deployments):
    for _command in _module.COMMANDS:
        main.add_command(_command)
main.add_command(schema_registry_command)

"""The `agentstream` command line: it parses options, resolves the configuration and calls what does the work.

A long-running process's `main` lives in the package of what it does (``pipeline/proxy/main.py``,
``trainer/worker_main.py``, ``deploy/gate_main.py``, ...); here it only gets its options. The
commands live in modules by area (``stack``, ``query``, ``serve``, ``training``, ``deployments``,
``schema_registry``); this module is the group that holds them.

A command that fails with an :class:`agentstream.AgentstreamError` prints ``error: <message>`` on
stderr and exits 1, or 75 (EX_TEMPFAIL) when the error is retriable: the group handles it once,
in :mod:`agentstream.cli.errors`, which states the contract.
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

from agentstream.cli import deployments, query, serve, stack, training
from agentstream.cli.errors import AgentstreamGroup
from agentstream.cli.schema_registry import schema_registry_command

__all__ = ["main"]


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

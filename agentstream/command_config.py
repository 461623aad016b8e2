"""The configuration of one `agentstream` command: what its ``--config`` option (or the default file) says.

Every command module (``cli``, ``schema_registry``) reads it from here, so none imports another.
"""

from __future__ import annotations

import click

from agentstream.infra.config import Config, load_config
from agentstream.infra.registry_client.client import use_configured_registry


def command_config(ctx: click.Context) -> Config:
    """The configuration; with ``[schema_registry] url`` set, this process's records use that registry's ids."""
    config = load_config(ctx.obj)
    use_configured_registry(config)
    return config

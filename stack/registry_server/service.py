"""The Schema Registry as a service of the local stack: started by ``up``, reported by ``status``, stopped by ``down``.

Without ``[schema_registry] url`` the stack runs its own registry process on the configured
port, over the stack's Kafka; with it, ``up`` starts nothing and registers agentstream's schemas
in the user's registry instead (after the compatibility check), so an incompatible change is
refused before anything writes a record.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from agentstream.infra.config import Config, dump_toml
from agentstream.infra.processes import ServiceDirectory
from agentstream.infra.registry_client.client import RegistryClient, configured_registry, register_product_schemas
from agentstream.infra.registry_client.errors import RegistryError, RegistryUnavailable
from agentstream.infra.security import KeySet

SCHEMA_REGISTRY = "schema-registry"


def registry_url(config: Config) -> str:
    """The registry agentstream uses: ``[schema_registry] url``, else the stack's own."""
    return config.schema_registry.url or f"http://{config.stack.host}:{config.schema_registry.port}"


STACK_CLIENT_NAME = "agentstream"
"""The user name agentstream's own client sends with its key (the stack's registry checks only the key)."""


def registry_client(config: Config) -> RegistryClient:
    """A client of the registry agentstream uses, with what lets it write there.

    The user's registry takes ``[schema_registry] username``/``password``; the stack's own takes the
    first of ``[security] registry_keys`` as the basic auth password.
    """
    settings = config.schema_registry
    if settings.external:
        return RegistryClient.from_config(settings)
    key = KeySet(config.security.registry_keys).client_key()
    return RegistryClient(registry_url(config), STACK_CLIENT_NAME if key else None, key, settings.timeout_s)


def start_registry(config: Config, services: ServiceDirectory, bootstrap_servers: str, timeout_s: float,
                   progress: Callable[[str], object]) -> str:
    """Start the stack's registry (or register the product's schemas in the user's); returns its URL."""
    settings = config.schema_registry
    url = registry_url(config)
    if settings.external:
        registry = configured_registry(config)
        assert registry is not None
        ids = register_product_schemas(registry)
        progress(f"schemas     {url}: {len(ids)} agentstream schemas registered "
                 f"({settings.compatibility.upper()} checked)")
        return url
    settings_file = services.private_file("schema-registry.toml", dump_toml(config))
    command = [sys.executable, "-m", "agentstream.stack.registry_server", "--config", str(settings_file),
               "--bootstrap-servers", bootstrap_servers]
    record = services.start(SCHEMA_REGISTRY, command, config.stack.host, settings.port, timeout_s)
    progress(f"schemas     registry pid {record.pid} on http://{record.address} "
             f"(topic {settings.topic_name(config.topics.prefix)})")
    return url


def registry_state(config: Config, services: ServiceDirectory) -> str:
    """One line for ``status``: who runs the registry and whether it answers."""
    if config.schema_registry.external:
        owner = "external"
    else:
        record = services.record(SCHEMA_REGISTRY)
        if record is None:
            return "not started by agentstream"
        if not record.alive():
            return f"pid {record.pid} DEAD (see {record.log_path})"
        owner = f"pid {record.pid} running"
    try:
        client = registry_client(config)
        client.timeout_s = 3.0
        return f"{owner}, {len(client.subjects())} subjects"
    except (RegistryError, RegistryUnavailable) as error:
        return f"{owner}, UNREACHABLE ({error})"

"""A client of the Confluent Schema Registry API for agentstream's schemas (the server is
:mod:`agentstream.stack.registry_server`).

- :mod:`.client`: a client of any Confluent-compatible registry, and the codec's registry on one;
- :mod:`.product`: the product's schemas as a registry holds them (one subject per record);
- :mod:`.errors`: Confluent's errors (``error_code``, ``message``) as named exceptions, shared with the server.
"""

from agentstream.infra.registry_client.client import (
    RegistryClient,
    RemoteRegistry,
    configured_registry,
    register_product_schemas,
    use_configured_registry,
)
from agentstream.infra.registry_client.errors import IncompatibleSchemaVersion, RegistryError, RegistryUnavailable

__all__ = [
    "IncompatibleSchemaVersion",
    "RegistryClient",
    "RegistryError",
    "RegistryUnavailable",
    "RemoteRegistry",
    "configured_registry",
    "register_product_schemas",
    "use_configured_registry",
]

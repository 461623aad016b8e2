"""The Confluent Schema Registry API for agentstream's schemas: a server over a compacted Kafka topic, and a client.

- :mod:`.server`: the REST API (``agentstream schema-registry``, started by ``agentstream up``);
- :mod:`.state` / :mod:`.store`: what it knows, rebuilt from its log (Kafka or memory);
- :mod:`.client`: a client of any Confluent-compatible registry, and the codec's registry on one;
- :mod:`.errors`: Confluent's errors (``error_code``, ``message``) as named exceptions.
"""

from infra.schema_registry.client import (
    RegistryClient,
    RemoteRegistry,
    configured_registry,
    register_product_schemas,
    use_configured_registry,
)
from infra.schema_registry.errors import IncompatibleSchemaVersion, RegistryError, RegistryUnavailable
from infra.schema_registry.server import RegistryService, create_app, serve
from infra.schema_registry.state import RegistryState
from infra.schema_registry.store import KafkaLog, MemoryLog

__all__ = [
    "IncompatibleSchemaVersion",
    "KafkaLog",
    "MemoryLog",
    "RegistryClient",
    "RegistryError",
    "RegistryService",
    "RegistryState",
    "RegistryUnavailable",
    "RemoteRegistry",
    "configured_registry",
    "create_app",
    "register_product_schemas",
    "serve",
    "use_configured_registry",
]

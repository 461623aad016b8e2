"""The stack's Schema Registry: the Confluent REST API for agentstream's schemas, over a compacted Kafka topic.

- :mod:`.server`: the REST API (``agentstream schema-registry``, started by ``agentstream up``);
- :mod:`.state` / :mod:`.store`: what it knows, rebuilt from its log (Kafka or memory);
- :mod:`.service`: the registry as a service of the local stack (``up``, ``status``, ``down``).

Its client and errors live in :mod:`agentstream.infra.registry_client`, since every process uses them.
"""

from agentstream.stack.registry_server.server import RegistryService, create_app, serve
from agentstream.stack.registry_server.state import RegistryState
from agentstream.stack.registry_server.store import KafkaLog, MemoryLog

__all__ = [
    "KafkaLog",
    "MemoryLog",
    "RegistryService",
    "RegistryState",
    "create_app",
    "serve",
]

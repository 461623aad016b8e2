"""The stack's Schema Registry: the Confluent REST API for agentstream's schemas, over a compacted Kafka topic.

- :mod:`.server`: the REST API (``agentstream schema-registry``, started by ``agentstream up``);
- :mod:`.state` / :mod:`.store`: what it knows, rebuilt from its log (Kafka or memory);
- :mod:`.service`: the registry as a service of the local stack (``up``, ``status``, ``down``).

Its client and errors live in :mod:`agentstream.infra.registry_client`, since every process uses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentstream.stack.registry_server.state import RegistryState
from agentstream.stack.registry_server.store import KafkaLog, MemoryLog

if TYPE_CHECKING:
    from agentstream.stack.registry_server.server import RegistryService, create_app, serve

_SERVER_NAMES = ("RegistryService", "create_app", "serve")

__all__ = [
    "KafkaLog",
    "MemoryLog",
    "RegistryService",
    "RegistryState",
    "create_app",
    "serve",
]


def __getattr__(name: str) -> Any:
    """The REST server's names, imported when first used: the stack's commands need the service, not aiohttp."""
    if name in _SERVER_NAMES:
        from agentstream.stack.registry_server import server
        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The [schema_registry] section: the stack's own Confluent-API registry, or the user's."""

from __future__ import annotations

from dataclasses import dataclass

from agentstream.infra.config.checks import Checks, spelled
from agentstream.infra.config.errors import Secret

SCHEMA_REGISTRY_IDS = ("fingerprint", "sequential")
COMPATIBILITY_LEVELS = ("BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL",
                        "FULL_TRANSITIVE", "NONE")


@dataclass(frozen=True)
class SchemaRegistryConfig:
    """The Confluent Schema Registry API: the stack's own, or the user's registry at ``url``.

    Without ``url``, ``agentstream up`` serves one on ``host:port`` (the stack's host), kept in
    the compacted topic ``topic`` (default ``<topics.prefix>_schemas``), whose ids are the
    content-addressed ids agentstream's records carry (``ids = "fingerprint"``; ``sequential``
    numbers them 1, 2, 3 like Confluent). With ``url`` (a registry serving the Confluent REST
    API; tested only against the stack's own server), agentstream registers its schemas there,
    one subject per record full name, checks ``compatibility`` against the latest version
    before using a new one, and writes that registry's ids; ``username``/``password`` are HTTP
    basic auth (an API key and secret).
    """

    url: str | None = None
    username: str | None = None
    password: Secret | None = None
    port: int = 8081
    topic: str | None = None
    ids: str = "fingerprint"
    compatibility: str = "BACKWARD"
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check = Checks("schema_registry", self)
        check.http_url("url")
        check.port("port")
        check.one_of("ids", SCHEMA_REGISTRY_IDS)
        check.must("compatibility", self.compatibility.upper() in COMPATIBILITY_LEVELS,
                   f"be {spelled(COMPATIBILITY_LEVELS)}")
        check.above("timeout_s", 0)

    @property
    def external(self) -> bool:
        return self.url is not None

    def topic_name(self, prefix: str) -> str:
        """The registry's topic: ``topic`` when set, else ``<prefix>_schemas``."""
        return self.topic or f"{prefix}_schemas"

"""The [clickhouse] section: where ClickHouse is and who writes to it (credentials in its URL move to their fields)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from agentstream.infra.config.errors import ConfigError, Secret


@dataclass(frozen=True)
class ClickHouseConfig:
    """Where ClickHouse is; None url means the embedded engine served over ClickHouse HTTP."""

    url: str | None = None
    database: str = "agentstream"
    username: str = "default"
    password: Secret | None = None
    verify_tls: bool = True

    @property
    def external(self) -> bool:
        return self.url is not None

    def with_url_credentials(self) -> ClickHouseConfig:
        """This section with a user and password written in ``url`` moved to ``username`` and ``password``.

        ``CLICKHOUSE_URL=https://alice:secret@host:8443/`` is the usual way to say all three; the URL
        kept is the one without them, and a bare ``host:port`` is taken as ``http://``.
        """
        if not self.url:
            return self
        parts = urlsplit(self.url if "://" in self.url else f"http://{self.url}")
        if parts.scheme not in ("http", "https"):
            raise ConfigError(f"clickhouse.url must be http:// or https://, got scheme {parts.scheme!r}")
        updates: dict[str, Any] = {}
        if parts.username:
            updates["username"] = unquote(parts.username)
        if parts.password:
            updates["password"] = Secret(unquote(parts.password))
        netloc = parts.hostname or "localhost"
        if parts.port:
            netloc = f"{netloc}:{parts.port}"
        updates["url"] = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
        return replace(self, **updates)

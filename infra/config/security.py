"""The [security] section: API keys of the servers that face users, feedback tokens, and where servers may bind."""

from __future__ import annotations

from dataclasses import dataclass

from agentstream.infra.config.errors import Secret


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call what: API keys for the servers that face users, feedback tokens, and where servers may bind.

    Every ``*_keys`` value is a comma-separated list of keys (``Secret``: never printed). Unset means
    that server takes any caller, which :func:`agentstream.infra.security.check_bind` allows only on loopback.
    ``proxy_keys``: the LLM proxy's OpenAI routes and Agent Lightning event API
    (``Authorization: Bearer <key>``, what the openai SDK sends as ``api_key``). ``collector_keys``:
    the OTLP receiver (``OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<key>``).
    ``registry_keys``: writes to the stack's Schema Registry (Bearer, or HTTP basic auth with the key
    as password, what ``basic.auth.user.info`` sends); reads stay open. ``dashboard_keys``: the
    dashboard. ``admin_token``: the model server's weight-loading routes, which only hot swap calls.
    ``clickhouse_readers``: ``user:password`` pairs the embedded ClickHouse front serves read-only
    (its writer is ``[clickhouse] username``/``password``).

    ``feedback_tokens`` (on by default) makes ``POST /rollouts/{id}/reward`` take only a token made
    for that rollout (HMAC-SHA256 of the rollout id under ``feedback_secret``), which the proxy hands
    the service on every LLM response (``X-Agentstream-Feedback-Token``) for it to put in the feedback
    URL it gives its user, so a guessed rollout id cannot be rewarded. Without ``feedback_secret`` the
    stack keeps a random one in ``<home>/feedback.secret``; proxies on several hosts need the same one
    configured. ``allow_open_bind`` lets a server without keys listen beyond loopback (not advised).
    """

    proxy_keys: Secret | None = None
    collector_keys: Secret | None = None
    registry_keys: Secret | None = None
    dashboard_keys: Secret | None = None
    admin_token: Secret | None = None
    clickhouse_readers: Secret | None = None
    feedback_tokens: bool = True
    feedback_secret: Secret | None = None
    allow_open_bind: bool = False

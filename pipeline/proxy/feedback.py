"""Feedback URLs for end users: the proxy's reward endpoint for one rollout, with that rollout's token.

The proxy hands each rollout's token on its LLM responses (``X-Agentstream-Feedback-Token``); a
trusted backend that holds the configuration can also mint it with :func:`feedback_token`, for
instance to send a feedback link by mail later. Whoever holds the URL can reward that rollout only.
"""

from __future__ import annotations

from urllib.parse import quote, urlencode

from agentstream.infra import security
from agentstream.infra.config import Config, load_config


def proxy_feedback_secret(config: Config) -> bytes | None:
    """The secret the proxy makes feedback tokens with, or None when ``[security] feedback_tokens`` is off."""
    if not config.security.feedback_tokens:
        return None
    return security.feedback_secret(config.security, config.stack.home)


def feedback_token(rollout_id: str, config: Config | None = None) -> str | None:
    """``rollout_id``'s feedback token under ``config`` (default: the loaded configuration); None when tokens are off.

    It must be the proxy's configuration: the same ``[security] feedback_secret``, or the same stack home.
    """
    secret = proxy_feedback_secret(config if config is not None else load_config())
    return None if secret is None else security.feedback_token(secret, rollout_id)


def feedback_url(proxy_url: str, rollout_id: str, token: str | None) -> str:
    """The URL a user POSTs ``{"reward": 1.0}`` to for ``rollout_id``: the token in the query when there is one."""
    url = f"{proxy_url.rstrip('/')}/rollouts/{quote(rollout_id, safe='')}/reward"
    return url if token is None else f"{url}?{urlencode({security.FEEDBACK_TOKEN_PARAM: token})}"

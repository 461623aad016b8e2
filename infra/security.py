"""Who may call a server: API keys, per-rollout feedback tokens and the loopback rule, shared by every server.

Each server that faces callers (proxy, collector, Schema Registry, dashboard, model server's admin
routes, ClickHouse front) holds a :class:`KeySet` built from its ``[security]`` setting and asks it
whether a request's credentials are among its keys; an empty set takes any caller, which
:func:`check_bind` allows only on loopback.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from agentstream.infra.config import ConfigError, Secret, SecurityConfig

FEEDBACK_TOKEN_HEADER = "X-Agentstream-Feedback-Token"
FEEDBACK_TOKEN_PARAM = "token"
FEEDBACK_SECRET_FILE = "feedback.secret"
_LOOPBACK_NAMES = {"localhost", "ip6-localhost", "ip6-loopback"}


class OpenBindRefused(ConfigError):
    """A server that checks no key was asked to listen on an address beyond loopback."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) reaches this machine only."""
    name = host.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class KeySet:
    """The keys one server accepts (a comma-separated ``Secret``); an empty set accepts every caller."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Secret | str | None) -> None:
        text = keys.reveal() if isinstance(keys, Secret) else (keys or "")
        self._keys = tuple(key.strip().encode() for key in text.split(",") if key.strip())

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __repr__(self) -> str:
        return f"KeySet({len(self._keys)} keys)"

    def client_key(self) -> str | None:
        """The key the stack's own clients present: the first listed (list a new key first to rotate), None if none."""
        return self._keys[0].decode() if self._keys else None

    def accepts(self, presented: str) -> bool:
        """Whether ``presented`` is one of the keys (compared in constant time, every key tried)."""
        candidate = presented.encode()
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(candidate, key)
        return matched

    def allows(self, headers: Mapping[str, str]) -> bool:
        """Whether a request with these headers may pass: no keys configured, or one of its credentials is a key."""
        return not self._keys or any(self.accepts(key) for key in presented_credentials(headers))


def presented_credentials(headers: Mapping[str, str]) -> list[str]:
    """The keys a request presents: ``Authorization: Bearer``, basic auth's password, ``api-key`` or ``x-api-key``.

    Bearer is what the openai SDK and OTLP exporters send; basic auth is what Schema Registry
    clients send (``basic.auth.user.info = name:key``); ``api-key`` is Azure OpenAI's header.
    """
    found: list[str] = []
    authorization = (headers.get("Authorization") or "").strip()
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        found.append(value.strip())
    elif scheme.lower() == "basic" and value.strip():
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            decoded = ""
        if ":" in decoded:
            found.append(decoded.split(":", 1)[1])
    for name in ("api-key", "x-api-key"):
        if headers.get(name):
            found.append(str(headers[name]).strip())
    return found


def check_bind(role: str, host: str, keys: KeySet, setting: str, security: SecurityConfig) -> None:
    """Refuse, in one line, to serve ``role`` beyond loopback with no keys, unless ``allow_open_bind`` says so.

    ``setting`` names where the keys go: a ``[security]`` key, or a full ``[section] key``.
    """
    if keys or is_loopback(host) or security.allow_open_bind:
        return
    where = setting if setting.startswith("[") else f"[security] {setting}"
    raise OpenBindRefused(
        f"refusing to serve the {role} on {host} without keys: anyone who reaches {host} could call it. "
        f"Set {where}, listen on 127.0.0.1, or set [security] allow_open_bind = true")


def feedback_secret(security: SecurityConfig, home: Path) -> bytes:
    """The key feedback tokens are made with: the configured one, else the stack's own (made once, mode 0600)."""
    if security.feedback_secret is not None and security.feedback_secret.reveal():
        return security.feedback_secret.reveal().encode()
    path = home / FEEDBACK_SECRET_FILE
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    home.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(32).encode()
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first: use theirs
        return path.read_bytes().strip()
    with os.fdopen(descriptor, "wb") as file:
        file.write(value)
    return value


def feedback_token(secret: bytes, rollout_id: str) -> str:
    """The token that lets its holder reward ``rollout_id`` and no other rollout (HMAC-SHA256, base64url)."""
    digest = hmac.new(secret, b"agentstream-feedback\x00" + rollout_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def feedback_token_valid(secret: bytes, rollout_id: str, presented: str | None) -> bool:
    """Whether ``presented`` is ``rollout_id``'s feedback token."""
    return bool(presented) and hmac.compare_digest(feedback_token(secret, rollout_id).encode(),
                                                   str(presented).encode())

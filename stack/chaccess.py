"""Who may send SQL to the embedded ClickHouse front: its users, their credentials, and no browser from elsewhere.

The writer is ``[clickhouse] username``/``password`` (what every component connects with);
``[security] clickhouse_readers`` lists read-only users as ``user:password`` pairs. Credentials
arrive as ClickHouse's HTTP interface takes them: basic auth, the ``X-ClickHouse-User``/
``X-ClickHouse-Key`` headers, or the ``user``/``password`` URL parameters. Without a writer
password the front is open (loopback only, see :func:`agentstream.infra.security.check_bind`). Requests a web
page makes from another site (``Origin``, ``Sec-Fetch-Site``) or through a rebound DNS name are
refused before any SQL runs, so a page open in the developer's browser cannot reach the data.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from agentstream.infra.config import Config, ConfigError
from agentstream.infra.security import is_loopback

DEFAULT_USER = "default"


class Access(enum.Enum):
    """What a request may do: the writer's requests write; a reader's run read-only whatever they ask."""

    WRITE = "write"
    READ = "read"


@dataclass(frozen=True)
class Credentials:
    """The user and password one request presents (ClickHouse's ``default`` with no password when it presents none)."""

    user: str = DEFAULT_USER
    password: str = ""


@dataclass(frozen=True)
class Users:
    """The front's accounts: one writer and any number of read-only readers; no writer password means open."""

    writer: str = DEFAULT_USER
    writer_password: str | None = None
    readers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.writer in self.readers:
            raise ConfigError(f"[security] clickhouse_readers names {self.writer!r}, which is the writer "
                              "([clickhouse] username): give readers their own names")
        if self.readers and not self.writer_password:
            raise ConfigError("[security] clickhouse_readers needs [clickhouse] password: without it any caller "
                              "may write, so read-only users protect nothing")

    @classmethod
    def from_config(cls, config: Config) -> Users:
        """The writer from ``[clickhouse]``, the readers from ``[security] clickhouse_readers``."""
        password = config.clickhouse.password.reveal() if config.clickhouse.password else ""
        readers = config.security.clickhouse_readers
        return cls(config.clickhouse.username or DEFAULT_USER, password or None,
                   parse_readers(readers.reveal() if readers else ""))

    @property
    def open(self) -> bool:
        """Whether any caller may write (no writer password configured)."""
        return self.writer_password is None

    def access(self, presented: Credentials) -> Access | None:
        """What these credentials may do, or None when they are wrong."""
        if presented.user in self.readers:
            return Access.READ if _same(presented.password, self.readers[presented.user]) else None
        if self.writer_password is None:
            return Access.WRITE
        if presented.user == self.writer and _same(presented.password, self.writer_password):
            return Access.WRITE
        return None


def parse_readers(text: str) -> dict[str, str]:
    """``"alice:pw1, bob:pw2"`` as {name: password}; a pair without a name or a password is a ConfigError."""
    readers: dict[str, str] = {}
    for pair in (item.strip() for item in text.split(",")):
        if not pair:
            continue
        name, colon, password = pair.partition(":")
        if not colon or not name.strip() or not password:
            raise ConfigError("[security] clickhouse_readers must be user:password pairs separated by commas; "
                              f"one entry has {'no password' if name.strip() else 'no user name'}")
        if name.strip() in readers:
            raise ConfigError(f"[security] clickhouse_readers names {name.strip()!r} twice")
        readers[name.strip()] = password
    return readers


def _same(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode(), expected.encode())


def presented(headers: Mapping[str, str], params: Mapping[str, str]) -> Credentials:
    """The credentials a request carries, in ClickHouse's order: basic auth, its headers, then URL parameters."""
    scheme, _, value = (headers.get("Authorization") or "").strip().partition(" ")
    if scheme.lower() == "basic" and value.strip():
        try:
            user, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return Credentials("", "\0")  # no such user: refused, never the default user
        return Credentials(user or DEFAULT_USER, password)
    if "X-ClickHouse-User" in headers or "X-ClickHouse-Key" in headers:
        return Credentials(headers.get("X-ClickHouse-User") or DEFAULT_USER, headers.get("X-ClickHouse-Key") or "")
    return Credentials(params.get("user") or DEFAULT_USER, params.get("password") or "")


def cross_site(headers: Mapping[str, str], scheme: str, *, loopback_names: bool) -> str | None:
    """Why a request comes from a web page of another site (None when it does not).

    Browsers mark every request a page makes: ``Sec-Fetch-Site`` (cross-site, same-site) and, on a
    POST, ``Origin``, which must be the front itself. With ``loopback_names`` (an open front on
    loopback) ``Host`` must also be a loopback name: a page whose DNS name was rebound to 127.0.0.1
    is same-origin to the browser but names its own host there.
    """
    site = (headers.get("Sec-Fetch-Site") or "").strip().lower()
    if site in ("cross-site", "same-site"):
        return f"Sec-Fetch-Site is {site}"
    host = (headers.get("Host") or "").strip().lower()
    origin = headers.get("Origin")
    if origin is not None and origin.strip().lower() != f"{scheme}://{host}":
        return f"Origin {origin.strip()[:100]!r} is not this server"
    if loopback_names and host and not is_loopback(urlsplit(f"//{host}").hostname or ""):
        return f"Host {host[:100]!r} is not a loopback name and the server has no password"
    return None

"""ClickHouse connections (clickhouse-connect over HTTP), the server version check, and migrations.

Migrations are the numbered ``.sql`` files in ``infra/migrations``; each is applied once per
database and recorded in ``schema_migrations``. Statements are written to be idempotent
(``IF NOT EXISTS``), so two processes migrating at once, or a crash halfway, is harmless.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import clickhouse_connect
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

from agentstream.infra.config import ClickHouseConfig
from agentstream.schemas.errors import AgentstreamError

log = logging.getLogger("agentstream.clickhouse")

MINIMUM_VERSION = (24, 3)
PRODUCT_TABLES = ("spans", "rollouts", "transitions", "checkpoints", "train_steps", "deployments")
ROLLOUT_POLICY_VERSION = "if(empty(policy_versions), NULL, arrayMax(policy_versions))"
"""SQL over ``rollouts``: the policy version a rollout counts under (the newest that generated any of its calls)."""
MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class ClickHouseError(AgentstreamError, RuntimeError):
    """ClickHouse is unreachable, too old, or refused a migration."""


class ClickHouseUnreachable(ClickHouseError):
    """No ClickHouse answered at the URL (refused, timed out, or the connection broke); it may answer later."""

    retriable = True


class UnsupportedClickHouse(ClickHouseError):
    """The server's version is older than the SQL agentstream runs needs."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()[:16]

    def statements(self, database: str) -> list[str]:
        body = "\n".join(line for line in self.sql.splitlines() if not line.lstrip().startswith("--"))
        return [s.strip().replace("{database}", database) for s in body.split(";") if s.strip()]


class _NoRetryWarnings(logging.Filter):
    """Drops urllib3's "Retrying ... Connection refused" warnings: connect() reports unreachability itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Retrying")


logging.getLogger("urllib3.connectionpool").addFilter(_NoRetryWarnings())


def connect(config: ClickHouseConfig, url: str, *, database: str | None = None, readonly: bool = False,
            timeout_s: float = 30.0) -> Client:
    """A clickhouse-connect client for ``url``; raises ClickHouseError if the server is unreachable or too old."""
    parts = urlsplit(url)
    settings = {"readonly": 1} if readonly else {}
    try:
        client = clickhouse_connect.get_client(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or (8443 if parts.scheme == "https" else 8123),
            secure=parts.scheme == "https",
            verify=config.verify_tls,
            username=config.username,
            password=config.password.reveal() if config.password else "",
            database=database or "",
            connect_timeout=min(timeout_s, 10),
            send_receive_timeout=max(timeout_s, 30),
            settings=settings,
        )
    except Exception as error:  # clickhouse-connect raises several types for "cannot reach"
        if isinstance(error, DatabaseError) and not isinstance(error, OperationalError):
            # the server answered and refused (an unknown database, a wrong password): asking again will not help
            raise ClickHouseError(f"ClickHouse at {url} refused the connection: {_first_line(error)}") from None
        raise ClickHouseUnreachable(f"cannot reach ClickHouse at {url}: {_first_line(error)}") from None
    assert client.server_version is not None  # get_client connects, which reads the version
    check_version(client.server_version, url)
    return client


class PatientReads:
    """A client whose reads are asked again while ClickHouse is too busy to answer in time, for up to ``patience_s``.

    For a process that watches a run on the same machine as the run (a demo's progress queries on
    two cores while a trainer and a model server take them): a read timing out there means
    "busy", not "gone". ``query`` retries an ``OperationalError`` (a timeout, a broken connection),
    telling ``progress`` each time; a refusal (bad SQL) raises at once, and so does the last
    timeout once the patience is spent. Everything else is the wrapped client's.
    """

    def __init__(self, client: Client, progress: Callable[[str], None], patience_s: float = 600.0,
                 pause_s: float = 2.0) -> None:
        self.client, self.progress, self.patience_s, self.pause_s = client, progress, patience_s, pause_s

    def query(self, sql: str, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.patience_s
        while True:
            try:
                return self.client.query(sql, **kwargs)
            except OperationalError as error:
                if time.monotonic() + self.pause_s > deadline:
                    raise
                self.progress(f"ClickHouse did not answer a progress query ({_first_line(error)}); asking again")
                time.sleep(self.pause_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def check_version(version: str, url: str) -> None:
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers < MINIMUM_VERSION:
        wanted = ".".join(map(str, MINIMUM_VERSION))
        raise UnsupportedClickHouse(
            f"ClickHouse {version} at {url} is too old: agentstream's tables and queries need {wanted} or newer"
        )


def wait_for_clickhouse(config: ClickHouseConfig, url: str, timeout_s: float) -> Client:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return connect(config, url)
        except UnsupportedClickHouse:
            raise
        except ClickHouseError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def load_migrations() -> list[Migration]:
    folder = resources.files("agentstream.infra") / "migrations"
    found = []
    for entry in folder.iterdir():
        match = MIGRATION_FILE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text()))
    return sorted(found, key=lambda m: m.version)


MIGRATE_ATTEMPTS = 5


def migrate(client: Client, database: str) -> list[Migration]:
    """Apply the migrations ``database`` has not seen yet; returns those applied now.

    Processes that start together (a stream worker and a trainer) migrate a fresh database at
    once: one may drop in a later migration what the other's earlier one is still building on. A
    failed statement is therefore retried a few times from what ``schema_migrations`` then says is
    applied (the other process has usually finished by then); only a statement that keeps failing
    is an error.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", database):
        raise ClickHouseError(f"database name {database!r} must be a plain identifier")
    client.command(f"CREATE DATABASE IF NOT EXISTS {database}")
    client.command(
        f"CREATE TABLE IF NOT EXISTS {database}.schema_migrations "
        "(version UInt32, name String, checksum String, applied_at DateTime64(3, 'UTC') DEFAULT now64(3)) "
        "ENGINE = ReplacingMergeTree ORDER BY version"
    )
    done: list[Migration] = []
    for attempt in range(1, MIGRATE_ATTEMPTS):
        try:
            _apply_missing(client, database, done)
            return done
        except ClickHouseError as error:
            log.info("%s; retrying from the migrations applied by then (another process may be migrating)", error)
            time.sleep(0.2 * attempt)
    _apply_missing(client, database, done)  # the last attempt: its error is the caller's
    return done


def _apply_missing(client: Client, database: str, done: list[Migration]) -> None:
    """Apply, in order, each migration ``schema_migrations`` does not list, appending it to ``done``."""
    applied = {row[0] for row in client.query(f"SELECT version FROM {database}.schema_migrations FINAL").result_rows}
    for migration in load_migrations():
        if migration.version in applied:
            continue
        for statement in migration.statements(database):
            try:
                client.command(statement)
            except Exception as error:
                raise ClickHouseError(f"migration {migration.version:04d}_{migration.name} failed: "
                                      f"{_first_line(error)}") from None
        client.insert(f"{database}.schema_migrations", [[migration.version, migration.name, migration.checksum]],
                      column_names=["version", "name", "checksum"])
        done.append(migration)


def table_counts(client: Client, database: str) -> dict[str, int]:
    """Rows per product table as a query sees them (FINAL, so replayed duplicates count once)."""
    counts = {}
    for table in PRODUCT_TABLES:
        try:
            counts[table] = int(client.query(f"SELECT count() FROM {database}.{table} FINAL").result_rows[0][0])
        except Exception:
            counts[table] = -1
    return counts


def server_message(error: Exception) -> str:
    """ClickHouse's own error text from a clickhouse-connect exception, without the client's wrapping."""
    text = str(error).strip()
    marker = "server response: "
    if marker in text:
        text = text[text.index(marker) + len(marker):]
    return re.sub(r"\s*\(for url [^)]*\)\s*$", "", text)


def query_error(error: Exception, prefix: str = "") -> ClickHouseError:
    """A clickhouse-connect exception from a statement as our error, ``prefix`` before the server's message:
    :class:`ClickHouseUnreachable` (retriable) when the connection failed or broke, else :class:`ClickHouseError`."""
    kind = ClickHouseUnreachable if isinstance(error, OperationalError) else ClickHouseError
    return kind(prefix + server_message(error))


def _first_line(error: Exception) -> str:
    text = str(error)
    if "Connection refused" in text or "Failed to establish a new connection" in text:
        return "connection refused"
    if "timed out" in text.lower():
        return "timed out"
    lines = server_message(error).splitlines()
    return lines[0] if lines else type(error).__name__

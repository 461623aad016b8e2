"""A client of any Confluent-compatible Schema Registry, and the codec's registry backed by one.

:class:`RemoteRegistry` is what agentstream's codec uses when ``[schema_registry] url`` names
the user's own registry (one serving the Confluent REST API; tested against the stack's own
server and Karapace, docs/schema-registry.md): a record schema is registered under its full name
the first time a process writes it, after agentstream has checked it against the subject's latest
version (BACKWARD by default, whatever level the registry itself enforces), and records carry the id
that registry assigned.
Ids read from records are resolved through the registry; ids it does not know fall back to the
bundled, content-addressed ones (records written before the registry was configured).
"""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from agentstream.infra.config import Config, SchemaRegistryConfig
from agentstream.infra.registry_client.errors import (
    IncompatibleSchemaVersion,
    RegistryError,
    RegistryUnavailable,
    SchemaNotFound,
    SubjectNotFound,
    Unauthorized,
    VersionNotFound,
    error_for,
)
from agentstream.infra.registry_client.product import product_schemas, subject_of
from agentstream.schemas.catalog import Schema, schema_json, self_contained
from agentstream.schemas.compatibility import check, parse
from agentstream.schemas.errors import UnknownSchemaId
from agentstream.schemas.schema_ids import BundledRegistry, schema_id, use_registry

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
CREDENTIALS_FROM = "[schema_registry] username and password (SCHEMA_REGISTRY_USERNAME, SCHEMA_REGISTRY_PASSWORD)"


class RegistryClient:
    """Synchronous calls to a Schema Registry's REST API; errors come back as the registry's named errors."""

    def __init__(self, url: str, username: str | None = None, password: str | None = None,
                 timeout_s: float = 10.0, credentials_from: str | None = None) -> None:
        """``credentials_from`` says where the user sets the credentials, for the error a refusal of them raises."""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.username, self.credentials_from = username, credentials_from
        self._headers = {"Accept": CONTENT_TYPE}
        if username is not None:
            token = base64.b64encode(f"{username}:{password or ''}".encode()).decode()
            self._headers["Authorization"] = f"Basic {token}"

    @classmethod
    def from_config(cls, config: SchemaRegistryConfig, url: str | None = None) -> RegistryClient:
        """A client of ``url`` (default: the configured one) with the configured credentials."""
        target = url or config.url
        if target is None:
            raise ValueError("no schema registry url")
        password = config.password.reveal() if config.password is not None else None
        return cls(target, config.username, password, config.timeout_s, CREDENTIALS_FROM)

    def call(self, method: str, path: str, body: Any = None, **query: str) -> Any:
        """One request; the decoded JSON answer, a RegistryError for an error answer, RegistryUnavailable else."""
        address = self.url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers, **({"Content-Type": CONTENT_TYPE} if data is not None else {}))
        request = urllib.request.Request(address, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            raw = error.read()
            try:
                answer = json.loads(raw)
                code, message = answer.get("error_code"), str(answer.get("message", raw))
            except (ValueError, AttributeError):
                code, message = None, raw.decode("utf-8", "replace")[:500]
            if error.code >= 500 and code is None:
                raise RegistryUnavailable(f"schema registry {self.url} answered {error.code}: {message}") from None
            if error.code in (401, 403):
                raise self._refused(method, path, error.code, code, message) from None
            raise error_for(error.code, code, message) from None
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise RegistryUnavailable(f"schema registry {self.url} is unreachable: {reason}") from None

    def _refused(self, method: str, path: str, status: int, code: int | None, message: str) -> RegistryError:
        """A 401 (always Unauthorized, whatever its ``error_code``) or 403 that names the registry, the request and
        the credentials sent: Confluent's and Karapace's own messages say only "Unauthorized" or "Forbidden"."""
        sent = f"as user {self.username!r}" if self.username is not None else "without credentials"
        where = f"; set them in {self.credentials_from}" if self.credentials_from else ""
        text = f"the schema registry at {self.url} refused {method} {path} {sent} ({status}: {message}){where}"
        return Unauthorized(text) if status == 401 else error_for(status, code, text)

    def schema(self, schema_id: int) -> str:
        """The schema text with this id."""
        return str(self.call("GET", f"/schemas/ids/{schema_id}")["schema"])

    def lookup(self, subject: str, schema: str) -> dict[str, Any] | None:
        """The subject's version holding ``schema`` (``subject``, ``version``, ``id``, ``schema``), or None."""
        try:
            return dict(self.call("POST", f"/subjects/{_quote(subject)}", {"schema": schema}))
        except (SubjectNotFound, SchemaNotFound):
            return None

    def versions(self, subject: str) -> list[dict[str, Any]]:
        """Every version of the subject, oldest first; empty when the subject does not exist."""
        try:
            numbers = self.call("GET", f"/subjects/{_quote(subject)}/versions")
        except SubjectNotFound:
            return []
        found = []
        for number in numbers:
            try:
                found.append(dict(self.call("GET", f"/subjects/{_quote(subject)}/versions/{number}")))
            except VersionNotFound:  # deleted meanwhile
                pass
        return found

    def latest(self, subject: str) -> dict[str, Any] | None:
        try:
            return dict(self.call("GET", f"/subjects/{_quote(subject)}/versions/latest"))
        except (SubjectNotFound, VersionNotFound):
            return None

    def register(self, subject: str, schema: str) -> int:
        """Register ``schema`` under ``subject`` and return its id."""
        return int(self.call("POST", f"/subjects/{_quote(subject)}/versions", {"schema": schema})["id"])

    def subjects(self) -> list[str]:
        return list(self.call("GET", "/subjects"))


def _quote(subject: str) -> str:
    return urllib.parse.quote(subject, safe="")


class RemoteRegistry:
    """The codec's :class:`~schemas.registry.SchemaRegistry` on a Schema Registry server (thread-safe, cached)."""

    def __init__(self, client: RegistryClient, compatibility: str = "BACKWARD") -> None:
        self.client = client
        self.compatibility = compatibility.upper()
        self._lock = threading.Lock()
        self._ids: dict[int, int] = {}  # content id -> the registry's id
        self._schemas: dict[int, Schema] = {}  # the registry's id -> schema
        self._bundled = BundledRegistry()

    def register(self, schema: Schema) -> int:
        """The registry's id for ``schema``, registering it after the compatibility check when it is new."""
        content_id = schema_id(schema)
        with self._lock:
            if content_id not in self._ids:
                self._ids[content_id] = self._register(schema)
                self._schemas.setdefault(self._ids[content_id], schema)
            return self._ids[content_id]

    def _register(self, schema: Schema) -> int:
        subject, text = subject_of(schema), schema_json(schema)
        found = self.client.lookup(subject, text)
        if found is not None:
            return int(found["id"])
        self.check(subject, text)
        try:
            return self.client.register(subject, text)
        except IncompatibleSchemaVersion as error:
            raise IncompatibleSchemaVersion(
                f"the schema registry at {self.client.url} refused the new schema of {subject}: {error.message}"
            ) from None

    def check(self, subject: str, text: str) -> None:
        """Raise IncompatibleSchemaVersion when ``text`` may not follow the subject's versions at our level."""
        if self.compatibility == "NONE":
            return
        if self.compatibility.endswith("_TRANSITIVE"):
            earlier = self.client.versions(subject)
        else:
            latest = self.client.latest(subject)
            earlier = [] if latest is None else [latest]
        if not earlier:
            return
        verdict = check(parse(text), [parse(str(v["schema"])) for v in earlier], self.compatibility)
        if not verdict.compatible:
            newest = earlier[-1]
            raise IncompatibleSchemaVersion(
                f"agentstream will not use its new schema of {subject}: it is not {self.compatibility} compatible "
                f"with version {newest['version']} (id {newest['id']}) in the schema registry at {self.client.url}. "
                + "; ".join(verdict.problems)
                + ". Give new fields defaults (and keep removed ones' defaults), or register the change under "
                  "a new record name.")

    def lookup(self, schema_id: int) -> Schema:
        """The writer schema with this id: from the registry, else (an id it does not know) a bundled one."""
        with self._lock:
            if schema_id in self._schemas:
                return self._schemas[schema_id]
            try:
                schema = self_contained(json.loads(self.client.schema(schema_id)))
            except SchemaNotFound:
                try:
                    schema = self._bundled.lookup(schema_id)
                except UnknownSchemaId:
                    raise UnknownSchemaId(schema_id) from None
            self._schemas[schema_id] = schema
            return schema


def configured_registry(config: Config) -> RemoteRegistry | None:
    """A RemoteRegistry on the user's registry when ``[schema_registry] url`` is set, else None."""
    settings = config.schema_registry
    if settings.url is None:
        return None
    return RemoteRegistry(RegistryClient.from_config(settings), settings.compatibility)


def use_configured_registry(config: Config) -> RemoteRegistry | None:
    """Install the user's registry (when configured) as the one every codec in this process uses.

    Nothing is contacted here: schemas are registered the first time they are written.
    """
    registry = configured_registry(config)
    if registry is not None:
        use_registry(registry)
    return registry


def register_product_schemas(registry: RemoteRegistry) -> dict[str, int]:
    """Register (after the compatibility check) every current product schema; the id of each subject."""
    return {subject: registry.register(schema) for subject, schema in product_schemas(history=False)}


"""The Confluent Schema Registry REST API over a :class:`~stack.schema_registry.store.SchemaLog`.

Every request confluent-kafka's ``SchemaRegistryClient`` makes but creating associations (501):
schemas by id and guid, subjects and versions with Confluent's filters, register and lookup, soft
and permanent deletes, compatibility tests, levels (``/config``), modes (``/mode``) and
``/contexts``; docs/schema-registry.md has the table. Errors are Confluent's ``{"error_code",
"message"}`` with its HTTP statuses. Schemas are AVRO and self-contained (no references). With keys
(``[security] registry_keys``), every POST, PUT and DELETE needs one (HTTP basic auth with the key
as password, as ``basic.auth.user.info = name:key`` sends it, or ``Authorization: Bearer``), else
401 with ``error_code`` 40101; reads stay open.

Run it with ``agentstream schema-registry`` or ``python -m agentstream.stack.registry_server``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from agentstream.infra.registry_client.errors import (
    AssociationNotFound,
    BadRequest,
    NotServed,
    OperationNotPermitted,
    RegistryError,
    SchemaNotFound,
    SubjectNotFound,
    Unauthorized,
)
from agentstream.infra.registry_client.product import product_schemas
from agentstream.infra.security import KeySet
from agentstream.schemas.catalog import Schema, schema_json
from agentstream.schemas.json_body import NotAJsonObject, json_object
from agentstream.stack.registry_server.state import (
    MAX_VERSION,
    Candidate,
    RegistryState,
    SchemaVersion,
    candidate,
    check_mode,
    check_subject,
    config_key,
    mode_key,
    schema_key,
)
from agentstream.stack.registry_server.store import SchemaLog

log = logging.getLogger("agentstream.schema_registry")

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
WRITE_METHODS = frozenset({"POST", "PUT", "DELETE"})


class RegistryService:
    """The registry's operations: reads from the state, writes through the log (one write at a time)."""

    def __init__(self, state: RegistryState, schema_log: SchemaLog) -> None:
        self.state = state
        self.log = schema_log
        self._writing = asyncio.Lock()

    async def start(self) -> None:
        await self.log.start(self.state.apply)

    async def stop(self) -> None:
        await self.log.stop()

    async def register(self, subject: str, schema: Candidate, imported: tuple[int, int | None] | None = None,
                       product: bool = False) -> SchemaVersion:
        """Register ``schema`` under ``subject`` (or find it there) and return its version; ``imported`` is the
        (id, version) an IMPORT-mode registration keeps; ``product``: one of agentstream's own (no checks)."""
        if not product:
            check_subject(subject)
        async with self._writing:
            planned, new = self.state.plan_register(subject, schema, imported=imported, product=product)
            if not new:
                return planned
            await self.log.append(schema_key(subject, planned.version), planned.log_value())
            return self.state.version(subject, planned.version)

    async def delete_subject(self, subject: str, permanent: bool) -> list[int]:
        """Soft-delete every live version of ``subject``, or, once soft-deleted, remove it for good; the versions
        touched."""
        async with self._writing:
            versions = self.state.plan_delete_subject(subject, permanent)
            for version in reversed(versions):
                await self._delete(version, permanent)
            return [version.version for version in versions]

    async def delete_version(self, subject: str, version: str, permanent: bool) -> int:
        async with self._writing:
            target = self.state.plan_delete_version(subject, version, permanent)
            await self._delete(target, permanent)
            return target.version

    async def _delete(self, version: SchemaVersion, permanent: bool) -> None:
        """Mark one version deleted, or remove it; a subject left with no version loses its own level and mode."""
        key = schema_key(version.subject, version.version)
        await self.log.append(key, None if permanent else replace(version, deleted=True).log_value())
        if permanent and self.state.is_empty(version.subject):
            has_level, has_mode = self.state.subject_settings(version.subject)
            if has_level:
                await self.log.append(config_key(version.subject), None)
            if has_mode:
                await self.log.append(mode_key(version.subject), None)

    async def set_level(self, subject: str | None, level: str | None) -> None:
        """Set the level (``None``: back to the global one, or to the default for the global level)."""
        if subject is not None:
            check_subject(subject)
        async with self._writing:
            await self.log.append(config_key(subject), None if level is None else {"compatibilityLevel": level})

    async def set_mode(self, subject: str | None, mode: str | None, force: bool = False) -> None:
        """Set the mode (``None``: the subject follows the global mode); IMPORT only where nothing is registered,
        unless ``force``."""
        if subject is not None:
            check_subject(subject)
        async with self._writing:
            if mode == "IMPORT" and not force and not self.state.is_empty(subject):
                raise OperationNotPermitted("Cannot import since found existing subjects")
            await self.log.append(mode_key(subject), None if mode is None else {"mode": mode})

    async def seed(self, schemas: Iterable[tuple[str, Schema]]) -> list[SchemaVersion]:
        """Make sure each (subject, schema) is registered, whatever the levels and modes (the product's own history,
        whose ids records carry)."""
        return [await self.register(subject, candidate(schema_json(schema)), product=True)
                for subject, schema in schemas]


@dataclass(frozen=True)
class _Routes:
    service: RegistryService

    @property
    def state(self) -> RegistryState:
        return self.service.state

    async def root(self, request: web.Request) -> web.Response:
        return _json({})

    async def schema_types(self, request: web.Request) -> web.Response:
        return _json(["AVRO"])

    async def contexts(self, request: web.Request) -> web.Response:
        return _json(_page(request, ["."]))

    async def schemas(self, request: web.Request) -> web.Response:
        """``GET /schemas``: every version (the latest of each subject with ``latestOnly``), by subject prefix."""
        prefix, deleted = request.query.get("subjectPrefix", ""), _flag(request, "deleted")
        found = []
        for subject in self.state.subjects(deleted):
            if subject.startswith(prefix):
                versions = self.state.versions(subject, deleted)
                found.extend(versions[-1:] if _flag(request, "latestOnly") else versions)
        return _json(_page(request, [version.body() for version in found]))

    async def schema_by_id(self, request: web.Request) -> web.Response:
        return _json(self.state.stored(_schema_id(request)).body())

    async def schema_by_guid(self, request: web.Request) -> web.Response:
        return _json(self.state.by_guid(request.match_info["guid"]).body())

    async def raw_schema_by_id(self, request: web.Request) -> web.Response:
        return web.Response(text=self.state.schema(_schema_id(request)), content_type="application/json")

    async def versions_of_id(self, request: web.Request) -> web.Response:
        pairs = self._holders(request)
        return _json(_page(request, [{"subject": s, "version": v} for s, v in pairs]))

    async def subjects_of_id(self, request: web.Request) -> web.Response:
        return _json(_page(request, sorted({s for s, _ in self._holders(request)})))

    def _holders(self, request: web.Request) -> list[tuple[str, int]]:
        pairs = self.state.subjects_of(_schema_id(request), _flag(request, "deleted"))
        subject = request.query.get("subject")
        return [(s, v) for s, v in pairs if subject is None or s == subject]

    async def subjects(self, request: web.Request) -> web.Response:
        prefix = request.query.get("subjectPrefix", "")
        names = self.state.subjects(_flag(request, "deleted"), _deleted_only(request))
        return _json(_page(request, [s for s in names if s.startswith(prefix)]))

    async def delete_subject(self, request: web.Request) -> web.Response:
        return _json(await self.service.delete_subject(request.match_info["subject"], _flag(request, "permanent")))

    async def versions(self, request: web.Request) -> web.Response:
        deleted_only = _deleted_only(request)
        versions = self.state.versions(request.match_info["subject"], deleted_only or _flag(request, "deleted"))
        return _json(_page(request, [v.version for v in versions if v.deleted or not deleted_only]))

    async def version(self, request: web.Request) -> web.Response:
        return _json(self._version(request).body())

    async def raw_version(self, request: web.Request) -> web.Response:
        return web.Response(text=self._version(request).schema, content_type="application/json")

    async def referenced_by(self, request: web.Request) -> web.Response:
        self._version(request)
        return _json([])  # schemas here are self-contained: nothing references another

    def _version(self, request: web.Request) -> SchemaVersion:
        return self.state.version(request.match_info["subject"], request.match_info["version"],
                                  _flag(request, "deleted"))

    async def delete_version(self, request: web.Request) -> web.Response:
        return _json(await self.service.delete_version(request.match_info["subject"], request.match_info["version"],
                                                       _flag(request, "permanent")))

    async def latest_with_metadata(self, request: web.Request) -> web.Response:
        keys, values = request.query.getall("key", []), request.query.getall("value", [])
        if len(keys) != len(values):
            raise BadRequest("every metadata 'key' needs a 'value'")
        stored = self.state.latest_with_metadata(request.match_info["subject"], dict(zip(keys, values, strict=True)),
                                                 _flag(request, "deleted"))
        return _json(stored.body())

    async def register(self, request: web.Request) -> web.Response:
        body = await _body(request)
        imported = None
        if body.get("id") is not None:
            imported = (_integer(body, "id"), None if body.get("version") is None else _integer(body, "version"))
        stored = await self.service.register(request.match_info["subject"], _candidate(body), imported=imported)
        return _json(stored.body())

    async def lookup(self, request: web.Request) -> web.Response:
        found = self.state.lookup(request.match_info["subject"], _candidate(await _body(request)),
                                  _flag(request, "deleted"))
        return _json(found.body())

    async def compatibility(self, request: web.Request) -> web.Response:
        schema = _candidate(await _body(request))
        verdict = self.state.compatibility(request.match_info["subject"], schema, request.match_info.get("version"))
        body: dict[str, Any] = {"is_compatible": verdict.compatible}
        if _flag(request, "verbose"):
            body["messages"] = verdict.problems
        return _json(body)

    async def get_config(self, request: web.Request) -> web.Response:
        subject = request.match_info.get("subject")
        return _json({"compatibilityLevel": self.state.level(subject, fallback=_flag(request, "defaultToGlobal"))})

    async def put_config(self, request: web.Request) -> web.Response:
        level = RegistryState.level_of(await _body(request))
        await self.service.set_level(request.match_info.get("subject"), level)
        return _json({"compatibility": level})

    async def delete_config(self, request: web.Request) -> web.Response:
        """The level deleted (a subject's own, else 40401; the global one goes back to the default)."""
        subject = request.match_info.get("subject")
        if subject is not None and not self.state.subject_settings(subject)[0]:
            raise SubjectNotFound(f"Subject '{subject}' not found.")
        old = self.state.level(subject)
        await self.service.set_level(subject, None)
        return _json({"compatibilityLevel": old})

    async def get_mode(self, request: web.Request) -> web.Response:
        subject = request.match_info.get("subject")
        return _json({"mode": self.state.mode(subject, fallback=_flag(request, "defaultToGlobal"))})

    async def put_mode(self, request: web.Request) -> web.Response:
        body = await _body(request)
        await self.service.set_mode(request.match_info.get("subject"), check_mode(body.get("mode")),
                                    _flag(request, "force"))
        return _json({"mode": body["mode"]})  # Confluent answers the request

    async def delete_mode(self, request: web.Request) -> web.Response:
        """The subject's own mode, deleted (40401 when it has none): the subject follows the global mode again."""
        subject = request.match_info["subject"]
        if not self.state.subject_settings(subject)[1]:
            raise SubjectNotFound(f"Subject '{subject}' not found.")
        old = self.state.mode(subject)
        await self.service.set_mode(subject, None)
        return _json({"mode": old})

    async def associations(self, request: web.Request) -> web.Response:
        """None exist here, so a serializer's default subject strategy falls back to its naming strategy."""
        return _json(_page(request, []))

    async def delete_associations(self, request: web.Request) -> web.Response:
        raise AssociationNotFound(f"No association found for resource {request.match_info['resource']}")

    async def create_association(self, request: web.Request) -> web.Response:
        raise NotServed("creating associations (links from subjects to resources such as topics, a newer Confluent "
                        "API) is not served by agentstream's registry: its subjects follow record names")


def create_app(service: RegistryService, keys: KeySet | None = None) -> web.Application:
    """The aiohttp application serving ``service`` (writes only with one of ``keys``, when any); the caller starts
    and stops the service."""
    routes = _Routes(service)
    app = web.Application(middlewares=[_errors, _writers(keys or KeySet(None))], client_max_size=16 << 20)
    app.add_routes([
        web.get("/", routes.root),
        web.get("/contexts", routes.contexts),
        web.get("/schemas", routes.schemas),
        web.get("/schemas/types", routes.schema_types),
        web.get("/schemas/ids/{id}", routes.schema_by_id),
        web.get("/schemas/ids/{id}/schema", routes.raw_schema_by_id),
        web.get("/schemas/ids/{id}/versions", routes.versions_of_id),
        web.get("/schemas/ids/{id}/subjects", routes.subjects_of_id),
        web.get("/schemas/guids/{guid}", routes.schema_by_guid),
        web.get("/subjects", routes.subjects),
        web.delete("/subjects/{subject}", routes.delete_subject),
        web.get("/subjects/{subject}/metadata", routes.latest_with_metadata),
        web.get("/subjects/{subject}/versions", routes.versions),
        web.get("/subjects/{subject}/versions/{version}", routes.version),
        web.delete("/subjects/{subject}/versions/{version}", routes.delete_version),
        web.get("/subjects/{subject}/versions/{version}/schema", routes.raw_version),
        web.get("/subjects/{subject}/versions/{version}/referencedby", routes.referenced_by),
        web.post("/subjects/{subject}/versions", routes.register),
        web.post("/subjects/{subject}", routes.lookup),
        web.post("/compatibility/subjects/{subject}/versions", routes.compatibility),
        web.post("/compatibility/subjects/{subject}/versions/{version}", routes.compatibility),
        web.get("/config", routes.get_config),
        web.put("/config", routes.put_config),
        web.delete("/config", routes.delete_config),
        web.get("/config/{subject}", routes.get_config),
        web.put("/config/{subject}", routes.put_config),
        web.delete("/config/{subject}", routes.delete_config),
        web.get("/mode", routes.get_mode),
        web.put("/mode", routes.put_mode),
        web.get("/mode/{subject}", routes.get_mode),
        web.put("/mode/{subject}", routes.put_mode),
        web.delete("/mode/{subject}", routes.delete_mode),
        web.post("/associations", routes.create_association),
        web.get("/associations/resources/{namespace}/{name}", routes.associations),
        web.delete("/associations/resources/{resource}", routes.delete_associations),
    ])
    return app


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type=CONTENT_TYPE)


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "false").lower() == "true"


def _deleted_only(request: web.Request) -> bool:
    """Confluent's ``deletedOnly``; confluent-kafka's Python client sends it as ``deleted_only``."""
    return _flag(request, "deletedOnly") or _flag(request, "deleted_only")


def _page(request: web.Request, items: list[Any]) -> list[Any]:
    """``items`` from ``offset``, at most ``limit`` of them (a limit below 1 means all), as Confluent pages lists."""
    try:
        offset, limit = int(request.query.get("offset", 0)), int(request.query.get("limit", -1))
    except ValueError:
        raise BadRequest("'offset' and 'limit' must be integers") from None
    return items[max(offset, 0):][:limit] if limit > 0 else items[max(offset, 0):]


def _schema_id(request: web.Request) -> int:
    try:
        return int(request.match_info["id"])
    except ValueError:
        raise SchemaNotFound(f"Schema {request.match_info['id']} not found") from None


def _integer(body: dict[str, Any], name: str) -> int:
    """An IMPORT registration's ``id`` or ``version``: Java ints in Confluent's registry (an id is 4 bytes on the
    wire), so at most :data:`MAX_VERSION`; checked before anything is written."""
    value = body[name]
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_VERSION:
        raise BadRequest(f"'{name}' must be an integer in [1, {MAX_VERSION}]")
    return value


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        return json_object(await request.read() or b"{}")
    except NotAJsonObject as error:
        raise BadRequest(str(error)) from None


def _candidate(body: dict[str, Any]) -> Candidate:
    if "schema" not in body:
        raise BadRequest("the request body needs a 'schema' (the schema's JSON text)")
    return candidate(body["schema"], body.get("schemaType"), body.get("references"), body.get("metadata"),
                     body.get("ruleSet"))


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except RegistryError as error:
        return _json(error.body(), error.status)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _json({"error_code": error.status, "message": f"HTTP {error.status} {error.reason}"}, error.status)
    except Exception as error:
        log.exception("schema registry request %s %s failed", request.method, request.path)
        return _json({"error_code": 50001, "message": f"Error in the backend data store: {error!r}"}, 500)


def _writers(keys: KeySet) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware that lets a write through only with one of ``keys`` (every request when there are none)."""

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if request.method in WRITE_METHODS and not keys.allows(request.headers):
            raise Unauthorized("this registry takes writes only with a key: send one of [security] registry_keys "
                               "as the basic auth password (basic.auth.user.info = <any name>:<key>) or as "
                               "Authorization: Bearer <key>")
        return await handler(request)

    return check


async def serve(service: RegistryService, host: str, port: int, seed: bool = True,
                ready: Callable[[str], object] | None = None, stop: asyncio.Event | None = None,
                keys: KeySet | None = None) -> None:
    """Start ``service`` (seeded with the product's schemas), serve it on host:port until ``stop`` is set."""
    await service.start()
    runner: web.AppRunner | None = None
    try:
        if seed:
            await service.seed(product_schemas())
        runner = web.AppRunner(create_app(service, keys), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        if ready is not None:
            ready(f"http://{host}:{port}")
        await (stop or asyncio.Event()).wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        await service.stop()

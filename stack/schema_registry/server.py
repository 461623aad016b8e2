"""The Confluent Schema Registry REST API over a :class:`~stack.schema_registry.store.SchemaLog`.

The subset that serializers, deserializers and ClickHouse use: ``GET /schemas/ids/{id}``
(also ``/schema``, ``/versions``, ``/subjects``), ``GET /schemas/types``, ``GET /subjects``,
``GET /subjects/{s}/versions``, ``GET /subjects/{s}/versions/{v|latest}`` (and ``/schema``),
``POST /subjects/{s}/versions`` (register), ``POST /subjects/{s}`` (lookup),
``POST /compatibility/subjects/{s}/versions[/{v}]``, ``GET|PUT /config[/{s}]``, ``GET /mode``.
Errors are Confluent's ``{"error_code", "message"}`` with its HTTP statuses. Schemas are AVRO
and self-contained (no references). With keys (``[security] registry_keys``), every POST, PUT and
DELETE needs one (HTTP basic auth with the key as password, as ``basic.auth.user.info = name:key``
sends it, or ``Authorization: Bearer``), else 401 with ``error_code`` 40101; reads stay open.

Run it with ``agentstream schema-registry`` or ``python -m stack.schema_registry``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from infra.schema_registry.errors import BadRequest, RegistryError, SchemaNotFound, Unauthorized
from infra.schema_registry.product import product_schemas, schema_json
from infra.security import KeySet
from schemas.catalog import Schema
from stack.schema_registry.state import Candidate, RegistryState, SchemaVersion, candidate, config_key, schema_key
from stack.schema_registry.store import SchemaLog

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

    async def register(self, subject: str, schema: Candidate, check_compatibility: bool = True) -> SchemaVersion:
        """Register ``schema`` under ``subject`` (or find it there) and return its version."""
        async with self._writing:
            planned, new = self.state.plan_register(subject, schema, check_compatibility)
            if not new:
                return planned
            await self.log.append(schema_key(subject, planned.version),
                                  {"subject": subject, "version": planned.version, "id": planned.id,
                                   "schema": planned.schema, "deleted": False})
            return self.state.lookup(subject, schema)

    async def set_level(self, subject: str | None, level: str) -> None:
        async with self._writing:
            await self.log.append(config_key(subject), {"compatibilityLevel": level})

    async def seed(self, schemas: Iterable[tuple[str, Schema]]) -> list[SchemaVersion]:
        """Make sure each (subject, schema) is registered, without compatibility checks (the product's own history)."""
        return [await self.register(subject, candidate(schema_json(schema)), check_compatibility=False)
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

    async def schema_by_id(self, request: web.Request) -> web.Response:
        return _json({"schema": self.state.schema(_schema_id(request))})

    async def raw_schema_by_id(self, request: web.Request) -> web.Response:
        return web.Response(text=self.state.schema(_schema_id(request)), content_type="application/json")

    async def versions_of_id(self, request: web.Request) -> web.Response:
        return _json([{"subject": s, "version": v} for s, v in self.state.subjects_of(_schema_id(request))])

    async def subjects_of_id(self, request: web.Request) -> web.Response:
        return _json(sorted({s for s, _ in self.state.subjects_of(_schema_id(request))}))

    async def subjects(self, request: web.Request) -> web.Response:
        prefix = request.query.get("subjectPrefix", "")
        deleted = _flag(request, "deleted")
        return _json([s for s in self.state.subjects(deleted) if s.startswith(prefix)])

    async def versions(self, request: web.Request) -> web.Response:
        versions = self.state.versions(request.match_info["subject"], _flag(request, "deleted"))
        return _json([v.version for v in versions])

    async def version(self, request: web.Request) -> web.Response:
        return _json(self.state.version(request.match_info["subject"], request.match_info["version"]).body())

    async def raw_version(self, request: web.Request) -> web.Response:
        stored = self.state.version(request.match_info["subject"], request.match_info["version"])
        return web.Response(text=stored.schema, content_type="application/json")

    async def register(self, request: web.Request) -> web.Response:
        stored = await self.service.register(request.match_info["subject"], await _candidate(request))
        return _json({"id": stored.id})

    async def lookup(self, request: web.Request) -> web.Response:
        return _json(self.state.lookup(request.match_info["subject"], await _candidate(request)).body())

    async def compatibility(self, request: web.Request) -> web.Response:
        schema = await _candidate(request)
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

    async def mode(self, request: web.Request) -> web.Response:
        return _json({"mode": "READWRITE"})


def create_app(service: RegistryService, keys: KeySet | None = None) -> web.Application:
    """The aiohttp application serving ``service`` (writes only with one of ``keys``, when any); the caller starts
    and stops the service."""
    routes = _Routes(service)
    app = web.Application(middlewares=[_errors, _writers(keys or KeySet(None))], client_max_size=16 << 20)
    app.add_routes([
        web.get("/", routes.root),
        web.get("/schemas/types", routes.schema_types),
        web.get("/schemas/ids/{id}", routes.schema_by_id),
        web.get("/schemas/ids/{id}/schema", routes.raw_schema_by_id),
        web.get("/schemas/ids/{id}/versions", routes.versions_of_id),
        web.get("/schemas/ids/{id}/subjects", routes.subjects_of_id),
        web.get("/subjects", routes.subjects),
        web.get("/subjects/{subject}/versions", routes.versions),
        web.get("/subjects/{subject}/versions/{version}", routes.version),
        web.get("/subjects/{subject}/versions/{version}/schema", routes.raw_version),
        web.post("/subjects/{subject}/versions", routes.register),
        web.post("/subjects/{subject}", routes.lookup),
        web.post("/compatibility/subjects/{subject}/versions", routes.compatibility),
        web.post("/compatibility/subjects/{subject}/versions/{version}", routes.compatibility),
        web.get("/config", routes.get_config),
        web.put("/config", routes.put_config),
        web.get("/config/{subject}", routes.get_config),
        web.put("/config/{subject}", routes.put_config),
        web.get("/mode", routes.mode),
    ])
    return app


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type=CONTENT_TYPE)


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "false").lower() == "true"


def _schema_id(request: web.Request) -> int:
    try:
        return int(request.match_info["id"])
    except ValueError:
        raise SchemaNotFound(f"Schema {request.match_info['id']} not found") from None


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError as error:
        raise BadRequest(f"the request body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def _candidate(request: web.Request) -> Candidate:
    body = await _body(request)
    if "schema" not in body:
        raise BadRequest("the request body needs a 'schema' (the schema's JSON text)")
    return candidate(body["schema"], body.get("schemaType"), body.get("references"))


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

"""The dashboard's HTTP server (aiohttp): the single-page app, its static assets and a JSON API over ClickHouse.

Routes:

- ``GET /`` the page (hash routes ``#overview``, ``#learning``, ``#llm``, ``#rollouts``, ``#rollout/<id>``);
- ``GET /static/...`` its script, styles and the vendored charting library (uPlot, MIT);
- ``GET /api/page/{overview|learning|llm}?window_s=&bucket_s=`` every panel of a page: its SQL, columns, rows;
- ``GET /api/rollouts?agent=&status=&version=&min_reward=&since_s=&limit=`` the filtered list and filter values;
- ``GET /api/rollouts/{rollout_id}`` one rollout: its row, its spans and the transitions it became.

Nothing is fetched from outside the machine: the page loads only what this server serves. With
``[security] dashboard_keys`` every route needs a key: a browser asks its user for one (basic auth,
any name, the key as password), a script sends ``Authorization: Bearer <key>``; anything else is 401.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from agentstream.dashboard import queries
from agentstream.dashboard.kafka_state import DEAD_LETTER_COLUMNS, LAG_COLUMNS, KafkaReader
from agentstream.dashboard.queries import Chart
from agentstream.dashboard.readonly_client import Warehouse, WarehouseError
from agentstream.infra.config import Config
from agentstream.infra.security import KeySet, check_bind
from agentstream.schemas.errors import AgentstreamError

log = logging.getLogger("agentstream.dashboard")

STATIC = Path(__file__).parent / "static"
DEFAULT_WINDOW_S = 900
DEMO_PORT = 8765  # `agentstream dashboard`'s default port too: the demo's URL is the usual one when free
POINTS_PER_SERIES = 60
MAX_WINDOW_S = 90 * 86400
NO_MIN_REWARD = -1e308  # the rollout list's SQL reads any min_reward <= -1e300 as "no reward filter"
WAREHOUSE_KEY: web.AppKey[Warehouse] = web.AppKey("warehouse", Warehouse)
KAFKA_KEY: web.AppKey[KafkaReader | None] = web.AppKey("kafka", KafkaReader)
WARM_KEY: web.AppKey[asyncio.Task] = web.AppKey("kafka_warm", asyncio.Task)
REALM = 'Basic realm="agentstream"'


class DashboardError(AgentstreamError, RuntimeError):
    """The dashboard cannot start (its port is taken, ClickHouse is unreachable)."""


def _int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    """An integer query parameter, clamped to [low, high]; a malformed one is a 400."""
    text = request.query.get(name, "")
    if text == "":
        return default
    try:
        return max(low, min(high, int(float(text))))
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a number, got {text!r}") from None


def window_parameters(request: web.Request) -> dict[str, int]:
    """The time window of a page's series and its bucket size (about 60 points per series by default)."""
    window_s = _int(request, "window_s", DEFAULT_WINDOW_S, 10, MAX_WINDOW_S)
    bucket_s = _int(request, "bucket_s", max(1, window_s // POINTS_PER_SERIES), 1, window_s)
    return {"window_s": window_s, "bucket_s": bucket_s, "limit": 20}


async def run_chart(warehouse: Warehouse, chart: Chart, parameters: dict[str, Any]) -> dict[str, Any]:
    """One panel's JSON: its description, SQL, and columns and rows (or the error ClickHouse gave)."""
    panel: dict[str, Any] = {**asdict(chart), "columns": [], "types": [], "rows": [], "elapsed_ms": 0.0, "error": ""}
    panel["parameter_values"] = {name: parameters[name] for name in chart.parameters if name in parameters}
    try:
        result = await warehouse.query(chart.sql, {name: parameters[name] for name in chart.parameters})
    except WarehouseError as error:
        panel["error"] = str(error)
        return panel
    panel.update(columns=[name for name, _ in result.columns], types=[kind for _, kind in result.columns],
                 rows=result.rows, elapsed_ms=round(result.elapsed_ms, 1))
    return panel


async def page(request: web.Request) -> web.Response:
    name = request.match_info["page"]
    charts = queries.PAGES.get(name)
    if charts is None:
        raise web.HTTPNotFound(text=f"no page {name!r}: pages are {', '.join(queries.PAGES)}")
    started = time.perf_counter()
    parameters = window_parameters(request)
    warehouse = request.app[WAREHOUSE_KEY]
    kafka = request.app[KAFKA_KEY]
    panels = list(await asyncio.gather(*(run_chart(warehouse, chart, parameters) for chart in charts)))
    body: dict[str, Any] = {"page": name, "panels": panels, **parameters}
    if name == "overview":
        body["kafka"] = await kafka_panels(kafka)
    body["elapsed_ms"] = round((time.perf_counter() - started) * 1000, 1)
    return web.json_response(body)


async def kafka_panels(kafka: KafkaReader | None) -> dict[str, Any]:
    """Consumer lag and dead letters, or why they are missing."""
    if kafka is None:
        return {"error": "no Kafka configured for the dashboard", "lag_columns": LAG_COLUMNS, "lag": [],
                "dlq_count": 0, "dead_letter_columns": DEAD_LETTER_COLUMNS, "dead_letters": []}
    state = await kafka.state()
    return {"error": state.error, "lag_columns": LAG_COLUMNS, "lag": state.lag, "dlq_count": state.dlq_count,
            "dlq_topic": kafka.dlq_topic, "dead_letter_columns": DEAD_LETTER_COLUMNS,
            "dead_letters": state.dead_letters, "elapsed_ms": round(state.elapsed_ms, 1)}


async def rollout_list(request: web.Request) -> web.Response:
    started = time.perf_counter()
    query = request.query
    try:
        min_reward = float(query["min_reward"]) if query.get("min_reward", "") != "" else NO_MIN_REWARD
    except ValueError:
        raise web.HTTPBadRequest(text="min_reward must be a number") from None
    parameters = {
        "agent": query.get("agent", ""), "status": query.get("status", ""),
        "version": _int(request, "version", -1, -1, 2**62), "min_reward": min_reward,
        "since_s": _int(request, "since_s", 0, 0, 10 * 365 * 86400), "limit": _int(request, "limit", 200, 1, 5000),
    }
    warehouse = request.app[WAREHOUSE_KEY]
    listing, facets = await asyncio.gather(run_chart(warehouse, queries.rollout_list(), parameters),
                                           run_chart(warehouse, queries.rollout_filters(), parameters))
    return web.json_response({"panels": [listing, facets],
                              "elapsed_ms": round((time.perf_counter() - started) * 1000, 1)})


async def rollout_detail(request: web.Request) -> web.Response:
    started = time.perf_counter()
    parameters = {"rollout_id": request.match_info["rollout_id"]}
    warehouse = request.app[WAREHOUSE_KEY]
    panels = await asyncio.gather(*(run_chart(warehouse, chart, parameters) for chart in queries.ROLLOUT_DETAIL))
    return web.json_response({"panels": list(panels), "elapsed_ms": round((time.perf_counter() - started) * 1000, 1)})


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def health(request: web.Request) -> web.Response:
    warehouse = request.app[WAREHOUSE_KEY]
    try:
        await warehouse.query("SELECT 1")
    except WarehouseError as error:
        return web.json_response({"ok": False, "error": str(error)}, status=503)
    return web.json_response({"ok": True, "database": warehouse.database})


def keyed(keys: KeySet) -> Callable[..., Any]:
    """A middleware that answers 401 (asking a browser for basic auth) to a request without one of ``keys``."""

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if not keys.allows(request.headers):
            raise web.HTTPUnauthorized(text="the dashboard needs a key: one of [security] dashboard_keys, as the "
                                            "password of basic auth (any user name) or Authorization: Bearer <key>",
                                       headers={"WWW-Authenticate": REALM})
        return await handler(request)

    return check


def check_dashboard_bind(config: Config, host: str) -> None:
    """Refuse, in one line, to serve the dashboard beyond loopback without ``[security] dashboard_keys``."""
    check_bind("dashboard", host, KeySet(config.security.dashboard_keys), "dashboard_keys", config.security)


def create_app(config: Config, clickhouse_url: str, bootstrap_servers: str | None, *,
               database: str | None = None) -> web.Application:
    """The dashboard application over ``database`` (default: the configured one) and, when given, Kafka."""
    keys = KeySet(config.security.dashboard_keys)
    app = web.Application(middlewares=[keyed(keys)] if keys else [])
    warehouse = Warehouse(config.clickhouse, clickhouse_url, database or config.clickhouse.database)
    app[WAREHOUSE_KEY] = warehouse
    app[KAFKA_KEY] = KafkaReader(config, bootstrap_servers) if bootstrap_servers else None

    async def open_warehouse(app: web.Application) -> None:
        await warehouse.start()
        kafka = app[KAFKA_KEY]
        if kafka is not None:  # the first overview then finds the broker's state ready
            app[WARM_KEY] = asyncio.create_task(kafka.refresh())

    async def close_warehouse(app: web.Application) -> None:
        await warehouse.close()
        kafka = app[KAFKA_KEY]
        if kafka is not None:
            app[WARM_KEY].cancel()
            await asyncio.gather(app[WARM_KEY], return_exceptions=True)
            await kafka.close()

    app.on_startup.append(open_warehouse)
    app.on_cleanup.append(close_warehouse)
    app.router.add_get("/", index)
    app.router.add_get("/favicon.ico", lambda request: web.Response(status=204))  # type: ignore[arg-type,return-value]
    app.router.add_get("/api/health", health)
    app.router.add_get("/api/page/{page}", page)
    app.router.add_get("/api/rollouts", rollout_list)
    app.router.add_get("/api/rollouts/{rollout_id}", rollout_detail)
    app.router.add_static("/static/", STATIC)
    return app


class DashboardThread:
    """The dashboard served from a background thread (the demos keep it up while they run; benches, tests).

    ``port`` 0 takes any free port; a taken preferred port falls back to a free one.
    """

    def __init__(self, config: Config, clickhouse_url: str, bootstrap_servers: str | None, *,
                 database: str | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        check_dashboard_bind(config, host)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dashboard", daemon=True)
        self.thread.start()
        app = create_app(config, clickhouse_url, bootstrap_servers, database=database)
        self.runner = web.AppRunner(app, access_log=None)
        self._call(self.runner.setup())
        try:
            self._call(web.TCPSite(self.runner, host, port).start())
        except OSError:
            if port == 0:
                self.stop()
                raise
            self._call(web.TCPSite(self.runner, host, 0).start())
        bound_host, bound_port = self.runner.addresses[0][:2]
        self.url = f"http://{bound_host}:{bound_port}"

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def stop(self) -> None:
        """Close the server and its connections, then the thread's loop."""
        try:
            self._call(self.runner.cleanup())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def start_beside(config: Config, endpoints: Any, say: Callable[[str], Any], *,
                 port: int = DEMO_PORT) -> DashboardThread | None:
    """The dashboard for a demo's stack and database, its URL said once; a failure is said, never raised."""
    try:
        dashboard = DashboardThread(config, endpoints.clickhouse_url, endpoints.bootstrap_servers, port=port)
    except Exception as error:  # the demo goes on without its dashboard
        say(f"dashboard: not started ({type(error).__name__}: {error})")
        return None
    say(f"dashboard: {dashboard.url}/  (live while the demo runs)")
    return dashboard


async def serve(config: Config, clickhouse_url: str, bootstrap_servers: str | None, *, host: str, port: int,
                database: str | None = None, started: Any = None) -> None:
    """Serve until cancelled; ``started(url)`` is called once the port is open."""
    check_dashboard_bind(config, host)
    runner = web.AppRunner(create_app(config, clickhouse_url, bootstrap_servers, database=database), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as error:
            raise DashboardError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
        bound_host, bound_port = runner.addresses[0][:2]
        if started is not None:
            started(f"http://{bound_host}:{bound_port}/")
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()

"""The LLM proxy: an OpenAI-compatible front that records every call as an LLM span with exact token ids.

Clients point their OpenAI base URL at ``http://proxy/rollouts/{rollout_id}/v1`` (or
``.../rollouts/{id}/attempts/{attempt}/agents/{agent}/v1``, what ``Rollout.llm_base_url()`` gives,
or send the ``X-Agentstream-Rollout`` header; Agent Lightning's ``/rollout/{id}/attempt/{attempt}/v1``
and ``/proxy/rollout/.../openai/v1`` shapes are aliases, and its 1.0 event API is served). The proxy asks
the upstream model server for token ids and logprobs (vLLM's ``return_token_ids`` / ``logprobs`` contract),
records one span per returned choice with the ids exactly as generated, and strips from the response
whatever the client did not ask for, so the client sees what it would have seen without the proxy. Streams are
relayed chunk by chunk as they arrive. Late rewards arrive at ``POST /rollouts/{id}/reward``.

It faces untrusted users, so it forwards only what they may call (``pipeline/proxy/access.py``): POST
``chat/completions`` and ``completions``, GET ``models`` (and ``models/{id}``) and POST ``embeddings``
under each prefix; any other method or path (a model server's admin routes included) gets the proxy's
own 404 and never reaches the model server. With API keys (``[security] proxy_keys``) every route but
``/health`` and the reward endpoint needs ``Authorization: Bearer <key>`` (the openai SDK's ``api_key``),
and the client's credentials are not forwarded upstream: they are the proxy's key, not the model
server's. With a feedback secret, every LLM response of a rollout carries that rollout's
``X-Agentstream-Feedback-Token``, and the reward endpoint takes only that token (``?token=`` or the
header), so a guessed rollout id cannot be rewarded; a service puts it in the feedback URL it hands
its user.

Requests for a trained model go to the version deployed for it (``deploy/routing.py``), and
every LLM span records the version that served it. ``X-Agentstream-Train: true|false`` opts a
request's rollout in or out of training (it is captured either way).

W3C trace context is honoured: a request with a ``traceparent`` header (what an OpenTelemetry-
instrumented HTTP client sends) that names no rollout otherwise belongs to the rollout of its trace
(rollout id = the trace id, as the OTLP receiver maps traces), and its LLM spans are children of
the client span that made the call; ``baggage`` entries ``agentstream.rollout_id``, ``attempt_id``,
``agent_name``, ``task_id``, ``group_id`` and ``train`` stand in for the X-Agentstream-* headers.

It is one module of about 500 lines on purpose: every endpoint ends in the same relay (streamed or not, on one
model server or across the fleet, retried before the first byte), which reads best beside the handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
from aiohttp import web

from agentstream.deploy.deployments import split_adapter_name
from agentstream.deploy.routing import RouteError, RoutingTable, resolve_route
from agentstream.infra.security import FEEDBACK_TOKEN_HEADER, KeySet, feedback_token
from agentstream.pipeline.proxy.access import (
    HEALTH_ROUTE,
    MODEL_ROUTES,
    REWARD_ROUTE,
    access_guard,
    feedback_refusal,
    not_served,
    upstream_headers,
)
from agentstream.pipeline.proxy.capture import (
    CallCapture,
    absorb,
    client_view,
    spans_of,
    upstream_request,
)
from agentstream.pipeline.proxy.trace_context import BAGGAGE_PREFIX, TraceContext, trace_context
from agentstream.pipeline.proxy.upstreams import RELIST_GAP_S, HealthSettings, Replica, UpstreamPool
from agentstream.pipeline.publisher import PublisherClosed, PublisherFull
from agentstream.pipeline.sdk import Rollout, build_span, new_id, now_us
from agentstream.schemas import EncodeError
from agentstream.schemas.contracts import (
    AGENT_HEADER,
    ATTEMPT_HEADER,
    GROUP_HEADER,
    POLICY_VERSION_HEADER,
    ROLLOUT_HEADER,
    TASK_HEADER,
    TRAIN_HEADER,
    VERSION_HEADER,
    RewardError,
    TrainFlagError,
    openai_error_body,
    parse_train_flag,
    policy_version,
    resolve_reward,
)
from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.json_body import NotAJsonObject, json_object
from agentstream.schemas.records import RolloutEventRecord, SpanRecord
from agentstream.schemas.responses_api import ResponsesAnswer, ResponsesRequestError, chat_request

log = logging.getLogger("agentstream.proxy")

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host",
              "upgrade", "proxy-authorization", "te", "trailer"}


# Agent Lightning's URL shapes, served as aliases: 0.3's ProxyLLM and 1.0's gateway (its mode is not needed here).
AGL_PREFIXES = ("/rollout/{rollout_id}/attempt/{attempt_id}",
                "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai")
PREFIXES = ("", "/rollouts/{rollout_id}", "/rollouts/{rollout_id}/attempts/{attempt_id}",
            "/rollouts/{rollout_id}/attempts/{attempt_id}/agents/{agent_name}", *AGL_PREFIXES)
AGL_EVENTS = "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"
AUTO_MODEL = "auto"  # Agent Lightning 1.0 agents ask for model "auto": the upstream's first model
HOLDER_WAIT_S = 5.0
"""How long a call for a deployed version that no model server holds waits for hot swap to load it into one (the
version was just promoted on another server, or its only holder died) before the 503; pinned versions do not wait."""


RETRY_AFTER_S = 1
"""What a caller told "retry later" (the span buffer is full: broker down and journal disk full) is asked to wait."""


class SpanOutlet(Protocol):
    """Where the proxy's spans go (the Kafka publisher): it answers "retry later" rather than block its loop."""

    @property
    def saturated(self) -> bool: ...

    def offer(self, spans: Sequence[SpanRecord], events: Sequence[RolloutEventRecord] = ()
              ) -> list[tuple[SpanRecord, EncodeError]]: ...

    async def publish_async(self, span: SpanRecord) -> None: ...


class UpstreamError(AgentstreamError):
    """The upstream model server could not be reached or answered something that is not a response."""

    retriable = True


def openai_error(status: int, message: str, error_type: str, param: str | None = None) -> web.Response:
    return web.json_response(openai_error_body(message, error_type, status, param), status=status)


def served_version(headers, capture: CallCapture) -> int | None:
    """The version that served a call: the server's X-Policy-Version (the dev server), else the route's.

    vLLM names no version, but the proxy chose the adapter, and an adapter is one version.
    """
    stated = policy_version(headers)
    if stated is not None or capture.route is None:
        return stated
    return capture.route.version


class LLMProxy:
    """The proxy application: routes, attribution, relay and capture.

    ``upstream``: one model server's URL, or several (a fleet: ``pipeline/proxy/upstreams.py`` picks one per
    request and ``health`` says how it checks them). ``keys``: the API keys callers must present
    (empty or None: any caller). ``feedback_secret``: what feedback tokens are made with (None:
    tokens off, the reward endpoint takes any caller); the CLI builds both from ``[security]``.
    """

    def __init__(self, upstream: str | Sequence[str], sink: SpanOutlet, *, agent_name: str | None = None,
                 timeout_s: float = 600.0, deployments: RoutingTable | None = None, max_tokens: int = 0,
                 keys: KeySet | None = None, feedback_secret: bytes | None = None,
                 health: HealthSettings | None = None) -> None:
        self.deployments = deployments
        self.keys = keys or KeySet(None)
        self.feedback_secret = feedback_secret
        self.max_tokens = max_tokens  # added to a chat request that names no limit (0: none added)
        self._auto_model: str | None = None
        self.pool = UpstreamPool([upstream] if isinstance(upstream, str) else list(upstream),
                                 health or HealthSettings())
        self.upstream = self.pool.replicas[0].url
        self._checking: asyncio.Task | None = None
        self.sink = sink
        self._busy_since: float | None = None  # when the proxy began answering "retry later"
        self.agent_name = agent_name
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self.session: aiohttp.ClientSession | None = None
        self.app = web.Application(client_max_size=64 << 20, middlewares=[access_guard(self.keys)])
        self.app.router.add_get("/health", self.health, name=HEALTH_ROUTE, allow_head=False)
        self.app.router.add_post("/rollouts/{rollout_id}/reward", self.reward, name=REWARD_ROUTE)
        self.app.router.add_post(AGL_EVENTS, self.agl_event)
        handlers = {"chat": self.chat, "completions": self.completions, "responses": self.responses,
                    "models": self.models, "model": self.model, "embeddings": self.embeddings}
        for prefix in PREFIXES:
            for route in MODEL_ROUTES:
                self.app.router.add_route(route.method, f"{prefix}/v1/{route.path}", handlers[route.name])
        self.app.on_startup.append(self._open)
        self.app.on_cleanup.append(self._close)

    async def _open(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=256, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, auto_decompress=True)
        if len(self.pool.replicas) > 1:  # one model server takes everything, as it always did: nothing to check
            await self.pool.check_all(self.session)  # who is up, and what each holds, before the first request
            self._checking = asyncio.create_task(self.pool.run(self.session))

    async def _close(self, app: web.Application) -> None:
        if self._checking is not None:
            self._checking.cancel()
            await asyncio.gather(self._checking, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "upstream": self.upstream, "upstreams": [
            {"url": r.url, "healthy": r.healthy, "outstanding": r.outstanding} for r in self.pool.replicas]})

    def _owner(self, request: web.Request, trace: TraceContext | None = None) -> Rollout:
        """Who a request belongs to: the path, then X-Agentstream-* headers, then baggage, then the trace."""
        trace = trace or trace_context(request.headers)
        bag = trace.baggage

        def named(match_key: str | None, header: str, baggage_key: str) -> str | None:
            return ((request.match_info.get(match_key) if match_key else None) or request.headers.get(header)
                    or bag.get(BAGGAGE_PREFIX + baggage_key) or None)

        rollout_id = named("rollout_id", ROLLOUT_HEADER, "rollout_id") or trace.trace_id
        attempt_id = named("attempt_id", ATTEMPT_HEADER, "attempt_id")
        agent = named("agent_name", AGENT_HEADER, "agent_name") or self.agent_name
        if not rollout_id:  # unattributed traffic is still recorded, as a rollout of its own
            rollout_id = f"unattributed-{new_id()}"
        return Rollout(rollout_id, attempt_id or f"{rollout_id}-1", agent_name=agent,
                       task_id=named(None, TASK_HEADER, "task_id"), group_id=named(None, GROUP_HEADER, "group_id"),
                       train=parse_train_flag(named(None, TRAIN_HEADER, "train")))

    async def reward(self, request: web.Request) -> web.Response:
        """A late reward (production feedback, possibly hours later) for a rollout, with its feedback token."""
        refused = feedback_refusal(self.feedback_secret, request.match_info["rollout_id"], request)
        if refused is not None:
            return refused
        if (body := await _json_object(request)) is None:
            return openai_error(400, "reward body must be a JSON object: {\"reward\": 1.0} or {\"dimensions\": {...}}",
                                "invalid_request_error")
        try:
            owner = self._owner(request)
        except TrainFlagError as error:
            return openai_error(400, str(error), "invalid_request_error")
        if body.get("attempt_id"):
            owner.attempt_id = str(body["attempt_id"])
        try:
            scalar, dimensions = resolve_reward(body.get("reward"), body.get("dimensions"), body.get("primary"))
        except RewardError as error:
            return openai_error(400, f"reward must be a number, or dimensions a map of numbers: {error}",
                                "invalid_request_error")
        at = now_us()
        span = build_span(owner, "reward", "REWARD", at, at, attributes={"agentstream.reward.late": True},
                          reward=scalar, reward_dimensions=dimensions)
        if (refused := self._offer(span)) is not None:
            return refused
        return web.json_response({"rollout_id": owner.rollout_id, "span_id": span["span_id"], "reward": scalar},
                                 status=202)

    async def agl_event(self, request: web.Request) -> web.Response:
        """Agent Lightning 1.0's event API: a ``reward`` event is a reward; any other is kept as an object span."""
        body = await _json_object(request)
        data = (body.get("data") or {}) if body is not None else None
        if body is None or not isinstance(body.get("event_type"), str) or not isinstance(data, dict):
            return openai_error(400, 'an event is {"event_type": "reward", "data": {"value": 1.0}}',
                                "invalid_request_error")
        try:
            owner = self._owner(request)
        except TrainFlagError as error:
            return openai_error(400, str(error), "invalid_request_error")
        at = now_us()
        if body["event_type"] == "reward":
            try:
                scalar, dimensions = resolve_reward(data.get("value"), data.get("dimensions"), data.get("primary"))
            except RewardError as error:
                return openai_error(400, f"a reward event needs data.value, a number: {error}", "invalid_request_error")
            extra = {key: value for key, value in data.items() if key in ("source", "reason")}
            span = build_span(owner, "reward", "REWARD", at, at, attributes={"agentlightning.event": "reward", **extra},
                              reward=scalar, reward_dimensions=dimensions)
        else:
            span = build_span(owner, body["event_type"], "OBJECT", at, at, attributes={"object": data})
        if (refused := self._offer(span)) is not None:
            return refused
        return web.json_response({"event_type": body["event_type"], "rollout_id": owner.rollout_id,
                                  "attempt_id": owner.attempt_id, "timestamp": at / 1e6, "data": data})

    async def _resolve_auto_model(self, body: dict[str, Any]) -> None:
        """Model ``auto`` becomes the upstream's first listed model (asked once)."""
        if body.get("model") != AUTO_MODEL:
            return
        replica = self.pool.pick(None)
        if self._auto_model is None and self.session is not None and replica is not None:
            try:
                async with self.session.get(f"{replica.url}/v1/models") as answer:
                    listed = (await answer.json()).get("data") or []
                    self._auto_model = str(listed[0]["id"]) if listed else None
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as error:
                log.warning("cannot list the upstream's models for model 'auto': %s", error)
        if self._auto_model is not None:
            body["model"] = self._auto_model

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST chat/completions, captured."""
        return await self._relay(request, "chat", "chat/completions")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """POST responses: relayed upstream as chat completions (captured as one), answered as a Response."""
        if (body := await _json_object(request)) is None:
            return openai_error(400, "request body must be a JSON object", "invalid_request_error")
        try:
            chat = chat_request(body)
        except ResponsesRequestError as error:
            return web.json_response(error.body(), status=400)
        return await self._relay(request, "chat", "chat/completions", chat, ResponsesAnswer(body))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST completions, captured."""
        return await self._relay(request, "text_completion", "completions")

    async def models(self, request: web.Request) -> web.Response:
        """GET models: the upstream's list."""
        return await self._forward(request, "models")

    async def model(self, request: web.Request) -> web.Response:
        """GET models/{id}: one model, its id's segments (``org/name``) each percent-encoded, dot segments refused."""
        segments = request.match_info["model_id"].split("/")
        if any(segment in ("", ".", "..") for segment in segments):
            return not_served(request)
        return await self._forward(request, "models/" + "/".join(quote(segment, safe="") for segment in segments))

    async def embeddings(self, request: web.Request) -> web.Response:
        """POST embeddings, forwarded (nothing to train on)."""
        return await self._forward(request, "embeddings")

    async def _relay(self, request: web.Request, operation: str, path: str, body: dict[str, Any] | None = None,
                     answer: ResponsesAnswer | None = None) -> web.StreamResponse:
        if body is None and (body := await _json_object(request)) is None:
            return openai_error(400, "request body must be a JSON object", "invalid_request_error")
        trace = trace_context(request.headers)
        try:
            owner = self._owner(request, trace)
        except TrainFlagError as error:
            return openai_error(400, str(error), "invalid_request_error")
        if self.sink.saturated:  # refused before the model runs: nothing generated is left unrecorded
            return self._busy("calls")
        self._taking_again()
        if operation == "chat" and self.max_tokens and body.get("max_tokens") is None \
                and body.get("max_completion_tokens") is None:
            body["max_tokens"] = self.max_tokens
        await self._resolve_auto_model(body)
        capture = CallCapture(operation, body, owner, now_us(), trace=trace, answer=answer)
        if self.deployments is not None and isinstance(body.get("model"), str):
            await self.deployments.current(split_adapter_name(body["model"])[0])
        try:
            capture.route = resolve_route(self.deployments, body.get("model"), request.headers.get(VERSION_HEADER),
                                          capture.owner.rollout_id)
        except RouteError as error:
            capture.error = str(error)
            await self._record(capture)
            return openai_error(error.status, str(error), "NotFoundError" if error.status == 404
                                else "invalid_request_error", param="model")
        headers = self._upstream_headers(request)
        try:
            return await self._relay_on_fleet(request, path, headers, capture)
        finally:
            await self._record(capture)

    async def _relay_on_fleet(self, request: web.Request, path: str, headers: dict[str, str],
                              capture: CallCapture) -> web.StreamResponse:
        """Relay on the replica the pool picks; one that fails before the first byte reaches the client, once more."""
        # a model the deployments know goes only where its version is; any other is the model server's to answer
        strict = capture.route is not None and capture.route.reason != "unrouted" and self.deployments is not None \
            and self.deployments.routing(capture.route.model) is not None
        tried: list[Replica] = []
        failure: web.StreamResponse | None = None
        waits = capture.route is not None and capture.route.reason != "pinned"
        while len(tried) < 2:
            replica = await self._choose(request, capture, strict, tried, waits)
            if replica is None:
                break
            if tried:
                self.pool.retries += 1
                capture.retried, capture.error, capture.policy_version = True, None, None
                log.warning("retrying a request that failed on %s before its first byte on %s",
                            tried[-1].url, replica.url)
            tried.append(replica)
            if len(self.pool.replicas) > 1:
                capture.upstream = replica.url
            with self.pool.busy(replica):
                relay = self._relay_stream if capture.request.get("stream") else self._relay_once
                response, retriable = await relay(request, replica, f"{replica.url}/v1/{path}", headers, capture)
            if not retriable:
                return response
            failure = response
        if failure is not None:
            return failure
        return self._none_holds(capture, _wanted(capture)[0])

    async def _choose(self, request: web.Request, capture: CallCapture, strict: bool, tried: list[Replica],
                      waits: bool) -> Replica | None:
        """A replica for the request: one holding its model; for a routed request, no other (``waits``: for up to
        :data:`HOLDER_WAIT_S` until one holds it)."""
        replica = self.pool.pick(*_wanted(capture), exclude=tried)
        if replica is None and strict and self.session is not None:
            replica = await self._holder(request, capture, tried, HOLDER_WAIT_S if waits else 0.0)
        if replica is None and not strict:
            replica = self.pool.pick(None, exclude=tried)  # the model server answers for names it does not know
        return replica

    async def _holder(self, request: web.Request, capture: CallCapture, tried: list[Replica],
                      wait_s: float) -> Replica | None:
        """A replica not yet tried that holds the routed version, relisting the fleet (hot swap may have loaded it
        since the last listing) until one does or ``wait_s`` has passed. A call that waits is routed again each
        round: hot swap loads the newest version, so one promoted meanwhile may be the only one any server gets."""
        assert self.session is not None
        deadline = time.monotonic() + wait_s
        while True:
            await self.pool.relist_all(self.session)
            replica = self.pool.pick(*_wanted(capture), exclude=tried)
            if replica is not None or time.monotonic() >= deadline:
                return replica
            await asyncio.sleep(RELIST_GAP_S)
            with contextlib.suppress(RouteError):  # the deployments changed under it: keep the route it had
                capture.route = resolve_route(self.deployments, capture.request.get("model"),
                                              request.headers.get(VERSION_HEADER), capture.owner.rollout_id)

    def _none_holds(self, capture: CallCapture, model: str | None) -> web.Response:
        """No model server holds the routed version: a pin is the client's error; a deployment on its way is not."""
        route = capture.route
        assert route is not None
        if route.reason == "pinned":
            capture.error = f"no model server holds `{model}`"
            return openai_error(404, f"version {route.version} of model `{route.model}` is held by no model server",
                                "NotFoundError", param="model")
        capture.error = f"no model server holds `{model}` yet"
        response = openai_error(503, f"no model server holds `{model}` ({route.reason} version of `{route.model}`) "
                                     f"yet; retry shortly", "service_unavailable")
        response.headers["Retry-After"] = "1"
        return response

    def _answered(self, replica: Replica, status: int, raw: bytes, capture: CallCapture,
                  content_type: str | None) -> tuple[web.Response, bool]:
        """The upstream's own error answer, passed on as it is; 502 and 503 may go to another replica instead."""
        capture.error = f"upstream HTTP {status}: {raw[:500].decode(errors='replace')}"
        if status >= 500:
            self.pool.failed(replica, f"HTTP {status}")
        else:
            self.pool.succeeded(replica)
        return (web.Response(status=status, body=raw, headers=self._response_headers(capture),
                             content_type=content_type or "application/json"), status in (502, 503))

    async def _relay_once(self, request: web.Request, replica: Replica, url: str, headers: dict[str, str],
                          capture: CallCapture) -> tuple[web.StreamResponse, bool]:
        assert self.session is not None
        try:
            async with self.session.post(url, json=upstream_request(capture.request, capture.operation, capture.route),
                                         headers=headers) as upstream:
                raw = await upstream.read()
                capture.policy_version = served_version(upstream.headers, capture)
                if upstream.status != 200:
                    return self._answered(replica, upstream.status, raw, capture, upstream.content_type)
                try:
                    payload = json.loads(raw)
                except ValueError:
                    raise UpstreamError(f"upstream answered non-JSON: {raw[:200]!r}") from None
        except (aiohttp.ClientError, TimeoutError, UpstreamError) as error:
            # nothing has reached the client yet: a broken connection may go to another replica
            return self._upstream_failed(capture, replica, error), _broken(error)
        self.pool.succeeded(replica)
        absorb(capture, payload, streamed=False)
        view = client_view(payload, capture.request, capture.operation)
        return web.json_response(capture.answer.whole(view) if capture.answer else view,
                                 headers=self._response_headers(capture)), False

    async def _relay_stream(self, request: web.Request, replica: Replica, url: str, headers: dict[str, str],
                            capture: CallCapture) -> tuple[web.StreamResponse, bool]:
        assert self.session is not None
        wants_usage = bool((capture.request.get("stream_options") or {}).get("include_usage"))
        try:
            forwarded = upstream_request(capture.request, capture.operation, capture.route)
            upstream = await self.session.post(url, json=forwarded, headers=headers)
        except (aiohttp.ClientError, TimeoutError) as error:
            return self._upstream_failed(capture, replica, error), _broken(error)
        async with upstream:
            capture.policy_version = served_version(upstream.headers, capture)
            if upstream.status != 200:
                try:
                    raw = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as error:
                    return self._upstream_failed(capture, replica, error), _broken(error)
                return self._answered(replica, upstream.status, raw, capture, upstream.content_type)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   **self._response_headers(capture)})
            await response.prepare(request)  # from here on, what fails is the client's to see
            if capture.answer:
                await response.write(capture.answer.opening())
            try:
                async for line in upstream.content:
                    out = self._stream_line(line, capture, wants_usage)
                    if out is not None:
                        await response.write(out)
            except (aiohttp.ClientError, TimeoutError) as error:
                capture.error = f"upstream stream broke: {error}"
                self.pool.failed(replica, capture.error)
                if capture.answer:
                    await response.write(capture.answer.broken(capture.error))
            except ConnectionResetError:
                capture.error = "client disconnected before the stream ended"
                return response, False
            else:
                self.pool.succeeded(replica)
                if capture.answer:
                    await response.write(capture.answer.closing())
            await response.write_eof()
            return response, False

    def _stream_line(self, line: bytes, capture: CallCapture, wants_usage: bool) -> bytes | None:
        text = line.strip()
        if not text.startswith(b"data:"):
            return line if text else None
        data = text[5:].strip()
        if data == b"[DONE]":
            return capture.answer.closing() if capture.answer else b"data: [DONE]\n\n"
        try:
            chunk = json.loads(data)
        except ValueError:
            capture.error = f"upstream sent a malformed stream chunk: {data[:200]!r}"
            return line + b"\n"
        absorb(capture, chunk, streamed=True)
        if not chunk.get("choices") and chunk.get("usage") and not wants_usage:
            return None  # the usage chunk we asked for on our own account
        if not wants_usage and "usage" in chunk and chunk.get("choices"):
            chunk.pop("usage", None)
        view = client_view(chunk, capture.request, capture.operation)
        if capture.answer:
            return capture.answer.chunk(view)
        return b"data: " + json.dumps(view, separators=(",", ":")).encode() + b"\n\n"

    def _upstream_failed(self, capture: CallCapture, replica: Replica, error: BaseException) -> web.Response:
        reason = str(error) or type(error).__name__
        capture.error = f"upstream unreachable or malformed: {reason}"
        log.warning("upstream %s failed: %s", replica.url, reason)
        self.pool.failed(replica, reason)
        return openai_error(502, f"the model server at {replica.url} failed: {reason}", "upstream_error")

    async def _record(self, capture: CallCapture) -> None:
        """The call's spans, waiting (off the loop) for buffer space: the model already ran, so they are kept."""
        for span in spans_of(capture, now_us()):
            await self.sink.publish_async(span)

    def _offer(self, span: SpanRecord) -> web.Response | None:
        """Queue a span a caller sent (a reward, an event) or answer why not: 503 to retry later, 400 if it is unfit."""
        if self.sink.saturated:  # the last quarter of the buffer is for the spans of calls in flight
            return self._busy("rewards and events")
        try:
            unfit = self.sink.offer([span])
        except (PublisherFull, PublisherClosed):
            return self._busy("rewards and events")
        self._taking_again()
        if unfit:
            return openai_error(400, f"the span does not fit the Span schema: {unfit[0][1]}", "invalid_request_error")
        return None

    def _taking_again(self) -> None:
        if self._busy_since is not None:
            log.warning("taking work again after %.1f s of 'retry later': the span buffer has room",
                        time.monotonic() - self._busy_since)
            self._busy_since = None

    def _busy(self, what: str) -> web.Response:
        """503 with Retry-After: earlier spans still wait for the broker and no disk can hold more."""
        if self._busy_since is None:
            self._busy_since = time.monotonic()
            log.warning("answering 'retry later' to new %s: the span buffer is full (the broker is unreachable and "
                        "the journal cannot take more)", what)
        response = openai_error(503, f"the proxy cannot record more {what} now: its span buffer waits for the "
                                f"broker; retry after {RETRY_AFTER_S}s", "service_unavailable")
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        return upstream_headers(_forward_headers(request.headers), self.keys)

    def _response_headers(self, capture: CallCapture) -> dict[str, str]:
        """The served version and, with tokens on, the rollout's feedback token: for the service to hand its user."""
        headers = _policy_header(capture)
        if self.feedback_secret is not None:
            headers[FEEDBACK_TOKEN_HEADER] = feedback_token(self.feedback_secret, capture.owner.rollout_id)
        return headers

    async def _forward(self, request: web.Request, path: str) -> web.Response:
        """Forward an allowed, uncaptured route (``path`` under the upstream's /v1, built here) as it is.

        It goes to the least busy replica, and to another once when the first cannot be reached.
        """
        assert self.session is not None
        body = await request.read()
        tried: list[Replica] = []
        failure = openai_error(502, "no model server to forward to", "upstream_error")
        while len(tried) < 2 and (replica := self.pool.pick(None, exclude=tried)) is not None:
            tried.append(replica)
            try:
                with self.pool.busy(replica):
                    async with self.session.request(request.method, f"{replica.url}/v1/{path}", params=request.query,
                                                    data=body, headers=self._upstream_headers(request)) as upstream:
                        answer = web.Response(status=upstream.status, body=await upstream.read(),
                                              content_type=upstream.content_type or "application/json")
            except (aiohttp.ClientError, TimeoutError) as error:
                self.pool.failed(replica, str(error) or type(error).__name__)
                failure = openai_error(502, f"the model server at {replica.url} failed: {error}", "upstream_error")
                if not isinstance(error, aiohttp.ClientConnectionError):
                    break
                continue
            self.pool.succeeded(replica)
            return answer
        return failure


def _broken(error: BaseException) -> bool:
    """A connection refused, reset or cut mid-answer (a request may go elsewhere), not a timeout or a bad answer."""
    return isinstance(error, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


def _wanted(capture: CallCapture) -> tuple[str | None, int | None]:
    """The model name a replica must list to take the request, and the weights version it must serve."""
    route = capture.route
    if route is None or route.reason == "unrouted":
        model = capture.request.get("model")
        return (model if isinstance(model, str) else None), None
    # an adapter is its own name; full weights (or the base model) are the server's one version
    version = route.version if route.upstream_model == route.model else None
    return route.upstream_model, version


def _forward_headers(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items()
            if k.lower() not in HOP_BY_HOP and not k.lower().startswith("x-agentstream-")}


def _policy_header(capture: CallCapture) -> dict[str, str]:
    return {} if capture.policy_version is None else {POLICY_VERSION_HEADER: str(capture.policy_version)}


async def serve_proxy(proxy: LLMProxy, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(proxy.app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner


async def _json_object(request: web.Request) -> dict[str, Any] | None:
    """The request's body as a JSON object, or None when it is not one."""
    try:
        return json_object(await request.read())
    except NotAJsonObject:
        return None

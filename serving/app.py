"""The dev model server's aiohttp app: vLLM's OpenAI-compatible HTTP contract over transformers, for CPU machines.

The proxy, runners and trainer talk to this server exactly as they talk to vLLM (>= 0.10.2):
``/v1/chat/completions`` and ``/v1/completions`` (streaming too) with vLLM's ``return_token_ids``
(top-level ``prompt_token_ids`` and ``choices[i].token_ids``; completions put
``prompt_token_ids`` on each choice), ``/v1/models``, ``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter`` and ``/health``. Under the dev contract (the default) the server
adds ``/v1/load_weights`` for full-weight updates, an adapter ``version`` field and an
``X-Policy-Version`` header on every response; under the vLLM contract it has none of these,
so the pipeline can be run against exactly what vLLM offers. This module is the router (routes
per contract), the guard on the admin routes, the middleware that renders errors and the hook
that stamps the version (dev contract only); ``handlers`` answers.

The admin routes (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, ``/v1/load_weights``:
they change what the server serves) take only callers presenting ``[security] admin_token``
(``Authorization: Bearer <token>``, what hot swap sends) when one is configured; others get 401.
Real vLLM has no such per-route token: its ``--api-key`` guards every route alike, so an operator
of vLLM keeps its port off the user network (bound to loopback or a private interface), puts the
agentstream proxy in front for users (it forwards only the OpenAI routes), and, with
``--api-key``, sets ``admin_token`` to that key for hot swap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from aiohttp import web
from aiohttp.typedefs import Handler

from agentstream.infra.security import KeySet
from agentstream.models import LoadedModel
from agentstream.schemas.contracts import POLICY_VERSION_HEADER, openai_error_body
from agentstream.serving.engine import ModelServer
from agentstream.serving.handlers import (
    CONTRACT,
    SERVED_VERSION,
    SERVER,
    chat_completions,
    completions,
    health,
    list_models,
    load_lora_adapter,
    load_weights,
    responses,
    unload_lora_adapter,
)
from agentstream.serving.protocol import Contract, RequestError, error_type_of

log = logging.getLogger("agentstream.model_server")

VLLM_UNAUTHORIZED = {"error": "Unauthorized"}
"""The body vLLM's ``--api-key`` check answers with, which the vLLM contract answers with too."""


def _error_response(status: int, message: str, error_type: str | None = None, param: str | None = None) -> web.Response:
    """vLLM's error response, its type named after the status unless given."""
    return web.json_response(openai_error_body(message, error_type or error_type_of(status), status, param),
                             status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render refusals, unknown routes and failures as vLLM-style errors."""
    try:
        return await handler(request)
    except RequestError as error:
        return _error_response(error.status, str(error), error.error_type, error.param)
    except web.HTTPException as error:
        return _error_response(error.status, error.reason)
    except Exception as error:
        log.exception("request failed: %s %s", request.method, request.path)
        return _error_response(500, f"internal error: {error}")


async def _stamp_version(request: web.Request, response: web.StreamResponse) -> None:
    """Stamp X-Policy-Version as headers go out: a generation's batch version, else the server's current one."""
    version = request.get(SERVED_VERSION)
    response.headers[POLICY_VERSION_HEADER] = str(request.app[SERVER].version if version is None else version)


def _unauthorized(contract: Contract) -> web.Response:
    """401 in the contract's own words: vLLM's bare body, or the dev server's error body saying what is missing."""
    body = VLLM_UNAUTHORIZED if contract is Contract.VLLM else openai_error_body(
        "this route changes what the server serves: it needs the model server's [security] admin_token "
        "as 'Authorization: Bearer <token>'", "AuthenticationError", 401)
    return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})


def _admin_only(handler: Handler, keys: KeySet, contract: Contract) -> Handler:
    """``handler``, answered only for callers presenting one of ``keys`` (everyone when none is configured)."""
    async def guarded(request: web.Request) -> web.StreamResponse:
        if not keys.allows(request.headers):
            log.warning("refused %s %s from %s: no valid admin token", request.method, request.path, request.remote)
            return _unauthorized(contract)
        return await handler(request)

    return guarded


def _routes(contract: Contract, admin: KeySet) -> list[web.RouteDef]:
    """vLLM's endpoints, plus ``/v1/load_weights`` where the contract serves policy versions; admin routes guarded."""
    admin_handlers: dict[str, Handler] = {"/v1/load_lora_adapter": load_lora_adapter,
                                          "/v1/unload_lora_adapter": unload_lora_adapter}
    if contract.versioned:
        admin_handlers["/v1/load_weights"] = load_weights
    return [
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.post("/v1/responses", responses),
        web.get("/v1/models", list_models),
        web.get("/health", health),
        *(web.post(path, _admin_only(handler, admin, contract)) for path, handler in admin_handlers.items()),
    ]


def create_app(loaded: LoadedModel, *, served_model_names: Sequence[str] = (),
               contract: Contract = Contract.DEV, max_tokens: int | None = None,
               admin_token: KeySet | None = None) -> web.Application:
    """The aiohttp application serving ``loaded`` under ``contract`` (used by ``serve`` and by tests).

    ``served_model_names``: the names the base model answers to (empty: the model's own name); several let
    several trained models share one base, each with its adapters (``<name>@v<N>``), as vLLM's aliases do.
    ``max_tokens`` bounds a chat completion that names no limit (None: up to the context, as vLLM does).
    ``admin_token`` is what the admin routes take (None or empty: any caller, for loopback use).
    """
    loaded.model.eval()
    server = ModelServer(loaded, served_model_names, max_tokens)
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
    app[SERVER] = server
    app[CONTRACT] = contract
    app.router.add_routes(_routes(contract, admin_token or KeySet(None)))
    if contract.versioned:
        app.on_response_prepare.append(_stamp_version)

    async def stop_generation(app: web.Application) -> None:
        await asyncio.to_thread(server.batcher.close)

    app.on_cleanup.append(stop_generation)
    return app


async def serve(loaded: LoadedModel, *, host: str = "127.0.0.1", port: int = 8000,
                served_model_names: Sequence[str] = (), contract: Contract = Contract.DEV,
                max_tokens: int | None = None, admin_token: KeySet | None = None) -> None:
    """Serve until cancelled."""
    runner = web.AppRunner(create_app(loaded, served_model_names=served_model_names, contract=contract,
                                      max_tokens=max_tokens, admin_token=admin_token), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("serving %s at http://%s:%d/v1 (%s contract; admin routes %s)",
                 ", ".join(served_model_names) or loaded.name,
                 host, port, contract, "need the admin token" if admin_token else "open to any caller")
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()

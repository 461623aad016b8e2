"""Who may call the LLM proxy, and what: the routes users may call, API keys, and per-rollout feedback tokens.

The proxy is the base URL a service hands its users, so it serves an allowlist (:data:`MODEL_ROUTES`
under each of its prefixes) and answers every other method or path with its own OpenAI-style 404,
never forwarding it: a model server's admin routes (``/v1/load_weights``, ``/v1/load_lora_adapter``,
``/v1/sleep``...) stay reachable on that server's own port only. With ``[security] proxy_keys`` set,
every route but :data:`OPEN_ROUTES` needs one of the keys; the reward endpoint needs instead the
feedback token of its rollout, which the proxy hands out on that rollout's LLM responses. The
stack's own clients (the runner's rollouts, the gate's evaluation, the demos) present
:func:`proxy_client_key`.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from agentstream.infra.config import Config
from agentstream.infra.security import (
    FEEDBACK_TOKEN_HEADER,
    FEEDBACK_TOKEN_PARAM,
    KeySet,
    feedback_token_valid,
    presented_credentials,
)
from agentstream.schemas.contracts import openai_error_body

CREDENTIAL_HEADERS = frozenset({"authorization", "api-key", "x-api-key"})  # what presented_credentials reads


@dataclass(frozen=True)
class ModelRoute:
    """One OpenAI route users may call, under a prefix's ``/v1/``."""

    method: str
    path: str
    name: str


MODEL_ROUTES = (
    ModelRoute("POST", "chat/completions", "chat"),
    ModelRoute("POST", "completions", "completions"),
    ModelRoute("POST", "responses", "responses"),
    ModelRoute("GET", "models", "models"),
    ModelRoute("GET", "models/{model_id:.+}", "model"),
    ModelRoute("POST", "embeddings", "embeddings"),
)
HEALTH_ROUTE, REWARD_ROUTE = "health", "reward"
OPEN_ROUTES = frozenset({HEALTH_ROUTE, REWARD_ROUTE})  # the reward endpoint checks a feedback token instead


def refusal(status: int, message: str, code: str | int, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI error response (type ``invalid_request_error``) with a named ``code``, as OpenAI's own refusals."""
    body = openai_error_body(message, "invalid_request_error", status)
    body["error"]["code"] = code
    return web.json_response(body, status=status, headers=headers)


def not_served(request: web.Request) -> web.Response:
    """The proxy's own 404 for anything outside the allowlist."""
    return refusal(404, f"{request.method} {request.path} is not served by this proxy: it serves POST "
                        "chat/completions, POST completions, POST responses, GET models and POST embeddings under /v1",
                   404)


def access_guard(keys: KeySet) -> Middleware:
    """The middleware that asks for a key (when ``keys`` has any) and answers unknown routes with :func:`not_served`.

    The key is checked before the route, so a caller without one learns nothing about which paths exist.
    """

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        match = request.match_info
        if keys and match.route.name not in OPEN_ROUTES and not keys.allows(request.headers):
            wrong = bool(presented_credentials(request.headers))
            return refusal(401, "the API key is not one of this proxy's keys" if wrong else
                           "this proxy needs an API key: send Authorization: Bearer <key> (the openai SDK's api_key)",
                           "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if match.http_exception is not None:  # no route (404) or not this method (405): never forwarded
            return not_served(request)
        return await handler(request)

    return guard


def feedback_refusal(secret: bytes | None, rollout_id: str, request: web.Request) -> web.Response | None:
    """Why a reward request may not reward ``rollout_id`` (401 no token, 403 another token), or None when it may."""
    if secret is None:
        return None
    presented = request.query.get(FEEDBACK_TOKEN_PARAM) or request.headers.get(FEEDBACK_TOKEN_HEADER)
    if not presented:
        return refusal(401, f"a reward needs the rollout's feedback token: ?{FEEDBACK_TOKEN_PARAM}=<token> or the "
                            f"{FEEDBACK_TOKEN_HEADER} header (the proxy returns it on the rollout's LLM responses)",
                       "missing_feedback_token")
    if not feedback_token_valid(secret, rollout_id, presented):
        return refusal(403, f"the feedback token is not rollout {rollout_id!r}'s", "invalid_feedback_token")
    return None


def upstream_headers(headers: dict[str, str], keys: KeySet) -> dict[str, str]:
    """Headers to send upstream: with keys configured, the client's credentials are the proxy's key and stay here."""
    if not keys:
        return headers
    return {name: value for name, value in headers.items() if name.lower() not in CREDENTIAL_HEADERS}


def proxy_client_key(config: Config) -> str | None:
    """The key the stack's own clients present to the proxy: the first of ``[security] proxy_keys``, None if unset.

    Taken from the configuration the proxy reads, so the runner, gate and demos pass its check
    wherever the keys are set (the file or ``AGENTSTREAM_PROXY_KEYS``).
    """
    return KeySet(config.security.proxy_keys).client_key()

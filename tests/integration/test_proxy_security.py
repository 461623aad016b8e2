"""The proxy faces untrusted users: it forwards only the OpenAI routes they may call, checks keys and feedback tokens.

Against the real dev model server in both contracts (``dev`` and exactly vLLM's), driven by the openai
SDK and raw HTTP; the model server records every request that reaches it, so "never forwarded" is
what it saw, not what the proxy said.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from aiohttp import web

import agentstream as ags
from agentstream.infra.config import Config, Secret
from agentstream.infra.kafka import topic_name
from agentstream.infra.processes import free_port
from agentstream.infra.security import FEEDBACK_TOKEN_HEADER, KeySet, feedback_token
from agentstream.models import load_model
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.serving.app import create_app
from agentstream.serving.protocol import Contract
from tests.support.http_thread import ServerThread
from tests.support.readback import read_topic
from tests.support.servers import make_lora

SECRET = b"the proxy's feedback secret"
HELLO = [{"role": "user", "content": "Say hello."}]
PREFIXES = ("/v1", "/rollouts/r-1/v1", "/rollouts/r-1/attempts/a-1/v1", "/rollouts/r-1/attempts/a-1/agents/bot/v1",
            "/rollout/r-1/attempt/a-1/v1", "/proxy/rollout/r-1/attempt/a-1/mode/m/openai/v1")
NOT_SERVED = "is not served by this proxy"


class ModelServer:
    """The real dev model server on a contract, with the adapter ``stable`` loaded on its own port, and what it saw."""

    def __init__(self, contract: Contract, folder: Path) -> None:
        self.contract = contract
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        app = create_app(load_model("tiny"), contract=contract)

        @web.middleware
        async def record(request: web.Request, handler):
            self.seen.append((request.method, request.raw_path, dict(request.headers)))
            return await handler(request)

        app.middlewares.append(record)
        self.thread = ServerThread(app)
        self.url = self.thread.url
        self.lora = folder / "stable"
        make_lora(self.lora)
        loaded = httpx.post(f"{self.url}/v1/load_lora_adapter",
                            json={"lora_name": "stable", "lora_path": str(self.lora)})
        assert loaded.status_code == 200, loaded.text  # on its own port the admin route works
        self.seen.clear()

    def state(self) -> dict[str, Any]:
        """What the server serves, asked on its own port (not recorded): models with their roots, its policy version."""
        seen = len(self.seen)
        listed = httpx.get(f"{self.url}/v1/models").json()["data"]
        health = httpx.get(f"{self.url}/health")
        del self.seen[seen:]
        return {"models": {m["id"]: m["root"] for m in listed}, "version": health.headers.get("X-Policy-Version")}


@pytest.fixture(scope="module", params=[Contract.DEV, Contract.VLLM], ids=["dev", "vllm"])
def server(request, tmp_path_factory):
    running = ModelServer(request.param, tmp_path_factory.mktemp(f"lora-{request.param}"))
    yield running
    running.thread.stop()


@pytest.fixture
def proxy(server: ModelServer, publisher: SpanPublisher):
    running = ServerThread(LLMProxy(server.url, publisher, feedback_secret=SECRET).app)
    server.seen.clear()
    yield running
    running.stop()


def assert_not_served(status: int, body: bytes) -> None:
    """The proxy's own 404, an OpenAI error body, not the model server's answer."""
    assert status == 404, body
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and NOT_SERVED in error["message"], error


def raw_request(base: str, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send ``target`` byte for byte (no client normalizes its dot segments or double slashes)."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request(method, target, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def admin_calls(server: ModelServer, weights: Path) -> list[tuple[str, dict[str, Any]]]:
    """Admin requests that, were they forwarded, would succeed and change what the server serves."""
    return [("load_weights", {"path": str(weights), "version": 7}),
            ("load_lora_adapter", {"lora_name": "intruder", "lora_path": str(server.lora)}),
            ("load_lora_adapter", {"lora_name": "stable", "lora_path": str(weights.parent / "other"),
                                   "load_inplace": True}),
            ("unload_lora_adapter", {"lora_name": "stable"}),
            ("sleep", {}), ("wake_up", {}), ("collective_rpc", {"method": "reload_weights"})]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """Valid full weights for the tiny model (a changed copy), and a second valid LoRA beside them."""
    folder = tmp_path_factory.mktemp("weights")
    updated = load_model("tiny")
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for parameter in updated.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    updated.model.save_pretrained(folder / "v7")
    make_lora(folder / "other")
    return folder / "v7"


def test_admin_routes_never_reach_the_model_server(server, proxy, weights):
    before = server.state()
    assert before["models"]["stable"] == str(server.lora)
    assert before["version"] == ("0" if server.contract is Contract.DEV else None)
    for prefix in PREFIXES:
        for route, body in admin_calls(server, weights):
            answer = httpx.post(f"{proxy.url}{prefix}/{route}", json=body)
            assert_not_served(answer.status_code, answer.content)
    client = openai.OpenAI(base_url=f"{proxy.url}/rollouts/r-admin/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        client.post("/unload_lora_adapter", body={"lora_name": "stable"}, cast_to=object)
    assert NOT_SERVED in raised.value.message
    tricks = [("POST", "/v1/%2e%2e/v1/load_lora_adapter"), ("POST", "/v1/chat/completions/../unload_lora_adapter"),
              ("POST", "/rollouts/r-1/v1/chat/completions/%2e%2e/%2e%2e/v1/load_weights"),
              ("POST", "//v1/load_lora_adapter"), ("POST", "/v1//unload_lora_adapter"),
              ("POST", "/rollouts/r-1/v1/../../v1/load_weights"), ("POST", "/v1/chat/completions%2f..%2fload_weights"),
              ("GET", "/v1/models/%2e%2e"), ("GET", "/v1/models/../load_weights"), ("GET", "/v1/models/a//b"),
              ("PUT", "/v1/chat/completions"), ("DELETE", "/v1/models"), ("GET", "/v1/chat/completions"),
              ("PATCH", "/rollouts/r-1/v1/completions"), ("POST", "/v1/models"), ("HEAD", "/v1/models"),
              ("OPTIONS", "/v1/chat/completions"), ("GET", "/v1/responses"), ("GET", "/metrics"),
              ("POST", "/load_lora_adapter"), ("GET", "/v1")]
    for method, target in tricks:
        status, body = raw_request(proxy.url, method, target, b'{"lora_name": "stable"}')
        if method == "HEAD":
            assert status == 404 and not body, (target, status)
        else:
            assert_not_served(status, body)
    # /v1/responses is served, and an admin body sent there is an unknown parameter, refused before any relay
    status, body = raw_request(proxy.url, "POST", "/v1/responses", b'{"lora_name": "stable"}')
    assert status == 400 and json.loads(body)["error"]["code"] == "unknown_parameter"
    assert server.seen == [], "nothing but allowed routes may reach the model server"
    assert server.state() == before, "the served adapters and policy version are unchanged"


def test_allowed_routes_are_forwarded_and_carry_the_feedback_token(server, proxy):
    client = openai.OpenAI(base_url=f"{proxy.url}/rollouts/r-allowed/v1", api_key="unused", max_retries=0)
    token = feedback_token(SECRET, "r-allowed")
    assert {m.id for m in client.models.list().data} == {"tiny", "stable"}
    for model in ("tiny", "stable"):
        raw = client.chat.completions.with_raw_response.create(model=model, messages=HELLO, max_tokens=4, seed=1)
        assert raw.headers[FEEDBACK_TOKEN_HEADER] == token and raw.parse().choices[0].message.content is not None
    raw = client.completions.with_raw_response.create(model="tiny", prompt="abc", max_tokens=4, seed=1)
    assert raw.headers[FEEDBACK_TOKEN_HEADER] == token and raw.parse().choices[0].text is not None
    streamed = client.chat.completions.with_raw_response.create(model="tiny", messages=HELLO, max_tokens=4,
                                                                stream=True, seed=1)  # unseeded, EOS first: 1 chunk
    assert streamed.headers[FEEDBACK_TOKEN_HEADER] == token and len(list(streamed.parse())) > 1
    streamed = client.completions.with_raw_response.create(model="tiny", prompt="abc", max_tokens=4, stream=True,
                                                           seed=1)
    assert streamed.headers[FEEDBACK_TOKEN_HEADER] == token and len(list(streamed.parse())) > 1
    # Allowed routes the dev server does not serve are still forwarded, and its own answer comes back.
    with pytest.raises(openai.NotFoundError) as raised:
        client.embeddings.create(model="tiny", input="abc")
    assert NOT_SERVED not in str(raised.value.body)
    assert httpx.get(f"{proxy.url}/v1/models/org/name").status_code == 404
    forwarded = [(method, path) for method, path, _ in server.seen]
    assert forwarded == [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("POST", "/v1/embeddings"), ("GET", "/v1/models/org/name")]
    assert all(headers.get("Authorization") == "Bearer unused" for _, _, headers in server.seen[:-1]), \
        "without proxy keys the client's credentials are the model server's business"


@pytest.fixture
def keyed(publisher: SpanPublisher, tmp_path):
    upstream = ModelServer(Contract.DEV, tmp_path)
    running = ServerThread(LLMProxy(upstream.url, publisher, keys=KeySet(Secret("key-one, key-two")),
                                    feedback_secret=SECRET).app)
    yield running, upstream
    running.stop()
    upstream.thread.stop()


def test_keys_are_needed_on_every_route_but_health_and_reward(keyed):
    proxy, upstream = keyed
    right = openai.OpenAI(base_url=f"{proxy.url}/rollouts/r-key/v1", api_key="key-two", max_retries=0)
    assert right.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4).choices
    assert {m.id for m in right.models.list().data} == {"tiny", "stable"}
    assert upstream.seen and all("Authorization" not in headers for _, _, headers in upstream.seen), \
        "the proxy's key is not forwarded to the model server"
    wrong = openai.OpenAI(base_url=f"{proxy.url}/rollouts/r-key/v1", api_key="key-three", max_retries=0)
    for call in (lambda: wrong.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4),
                 lambda: wrong.models.list(), lambda: wrong.completions.create(model="tiny", prompt="a", max_tokens=2)):
        with pytest.raises(openai.AuthenticationError) as raised:
            call()
        assert raised.value.code == "invalid_api_key" and raised.value.type == "invalid_request_error"
        assert raised.value.response.headers["WWW-Authenticate"] == "Bearer"
    events = f"{proxy.url}/api/rollouts/r-key/attempt/a-1/events"
    event = {"event_type": "reward", "data": {"value": 1.0}}
    for url, method in ((f"{proxy.url}/v1/chat/completions", "POST"), (f"{proxy.url}/v1/models", "GET"),
                        (events, "POST"), (f"{proxy.url}/v1/load_weights", "POST"), (f"{proxy.url}/nowhere", "GET")):
        answer = httpx.request(method, url, json=event if method == "POST" else None)
        assert answer.status_code == 401, (url, answer.text)
        assert answer.json()["error"]["code"] == "invalid_api_key" and "needs an API key" in answer.text
        assert answer.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.post(events, json=event, headers={"Authorization": "Bearer key-one"}).status_code == 200
    admin = httpx.post(f"{proxy.url}/v1/load_weights", json={}, headers={"Authorization": "Bearer key-one"})
    assert_not_served(admin.status_code, admin.content)
    assert httpx.get(f"{proxy.url}/health").status_code == 200
    reward = httpx.post(ags.feedback_url(proxy.url, "r-key", feedback_token(SECRET, "r-key")), json={"reward": 1.0})
    assert reward.status_code == 202, "end users hold only the feedback token, not a proxy key"


def spans_topic(config: Config) -> str:
    return topic_name(config.topics, "spans")


def test_a_reward_needs_its_rollouts_feedback_token(proxy, publisher, topics_config, kafka_options):
    client = openai.OpenAI(base_url=f"{proxy.url}/rollouts/r-fed/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=HELLO, max_tokens=4)
    token = raw.headers[FEEDBACK_TOKEN_HEADER]
    missing = httpx.post(f"{proxy.url}/rollouts/r-guessed/reward", json={"reward": 1.0})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_feedback_token"
    assert "feedback token" in missing.json()["error"]["message"]
    for stolen in ({"params": {"token": token}}, {"headers": {FEEDBACK_TOKEN_HEADER: token}},
                   {"params": {"token": "forged"}}):
        refused = httpx.post(f"{proxy.url}/rollouts/r-guessed/reward", json={"reward": 1.0}, **stolen)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "invalid_feedback_token"
    accepted = httpx.post(ags.feedback_url(proxy.url, "r-fed", token), json={"reward": 0.5})
    assert accepted.status_code == 202 and accepted.json()["reward"] == 0.5
    odd = openai.OpenAI(base_url=f"{proxy.url}/rollouts/svc%2Fuser%207/v1", api_key="unused", max_retries=0)
    odd_token = odd.chat.completions.with_raw_response.create(model="tiny", messages=HELLO, max_tokens=2).headers[
        FEEDBACK_TOKEN_HEADER]
    odd_url = ags.feedback_url(proxy.url, "svc/user 7", odd_token)
    assert odd_url.startswith(f"{proxy.url}/rollouts/svc%2Fuser%207/reward?token=")
    assert httpx.post(odd_url, json={"reward": 1.0}).status_code == 202, "the URL names the rollout the token is for"
    # A trusted backend mints the same token from the proxy's configuration, and the header works as the query does.
    config = replace(topics_config, security=replace(topics_config.security, feedback_secret=Secret(SECRET.decode())))
    minted = ags.feedback_token("r-mail", config)
    assert minted == feedback_token(SECRET, "r-mail")
    by_header = httpx.post(f"{proxy.url}/rollouts/r-mail/reward", json={"reward": 1.0},
                           headers={FEEDBACK_TOKEN_HEADER: minted})
    assert by_header.status_code == 202
    assert ags.feedback_token("r-mail", replace(config, security=replace(config.security,
                                                                         feedback_tokens=False))) is None
    publisher.flush(10)
    landed = read_topic(kafka_options, spans_topic(topics_config),
                        lambda got: any(s["kind"] == "REWARD" for s in got.of("r-mail")[0]), timeout_s=20)
    (reward,) = [s for s in landed.of("r-fed")[0] if s["kind"] == "REWARD"]
    assert reward["reward"] == 0.5
    assert landed.of("r-guessed") == ([], []), "a refused reward publishes nothing"


def test_without_a_secret_tokens_are_off(server, publisher):
    running = ServerThread(LLMProxy(server.url, publisher).app)
    try:
        client = openai.OpenAI(base_url=f"{running.url}/rollouts/r-open/v1", api_key="unused", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=HELLO, max_tokens=2)
        assert FEEDBACK_TOKEN_HEADER not in raw.headers
        assert httpx.post(f"{running.url}/rollouts/r-open/reward", json={"reward": 1.0}).status_code == 202
    finally:
        running.stop()


def test_the_cli_refuses_to_serve_the_proxy_beyond_loopback_without_keys(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("AGENTSTREAM_")}
    env["AGENTSTREAM_HOME"] = str(tmp_path / "home")
    result = subprocess.run([sys.executable, "-m", "agentstream", "proxy", "--host", "0.0.0.0", "--port",
                             str(free_port()), "--upstream", "http://127.0.0.1:9", "--no-deployments"],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "refusing to serve the LLM proxy on 0.0.0.0 without keys" in lines[0] and "proxy_keys" in lines[0]

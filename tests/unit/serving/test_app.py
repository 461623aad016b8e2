"""The model server's admin routes behind ``[security] admin_token``, on both contracts, over raw HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from agentstream.infra.security import KeySet
from agentstream.serving.app import create_app
from agentstream.serving.handlers import SERVER
from agentstream.serving.protocol import Contract
from tests.support.http_thread import ServerThread
from tests.support.servers import HELLO, make_lora

TOKEN = "admin-s3cret"


def call(url: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict | str, dict]:
    """GET (no body) or POST raw JSON, optionally with a bearer token; (status, parsed body, headers), errors too."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, raw, got = response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as error:
        status, raw, got = error.code, error.read().decode(), dict(error.headers)
    try:
        return status, json.loads(raw), got
    except json.JSONDecodeError:
        return status, raw, got


@pytest.fixture(scope="module", params=[Contract.DEV, Contract.VLLM], ids=str)
def guarded(request, tiny):
    running = ServerThread(create_app(tiny, contract=request.param, admin_token=KeySet(TOKEN)))
    yield running, request.param
    running.stop()


def assert_refused(answer: tuple[int, dict | str, dict], contract: Contract) -> None:
    status, body, headers = answer
    assert status == 401 and headers.get("WWW-Authenticate") == "Bearer"
    if contract is Contract.VLLM:
        assert body == {"error": "Unauthorized"}  # what vLLM's --api-key check answers
    else:
        assert isinstance(body, dict) and body["error"]["code"] == 401
        assert body["error"]["type"] == "AuthenticationError" and "admin_token" in body["error"]["message"]


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""], ids=["none", "wrong", "longer", "empty"])
def test_admin_routes_refuse_callers_without_the_token_and_change_nothing(guarded, token, tmp_path):
    running, contract = guarded
    make_lora(tmp_path / "adapter")
    server = running.app[SERVER]
    load = {"lora_name": "intruder", "lora_path": str(tmp_path / "adapter")}
    assert_refused(call(running.url + "/v1/load_lora_adapter", load, token), contract)
    assert_refused(call(running.url + "/v1/unload_lora_adapter", {"lora_name": "intruder"}, token), contract)
    weights = call(running.url + "/v1/load_weights", {"path": str(tmp_path), "version": 9}, token)
    if contract is Contract.DEV:
        assert_refused(weights, contract)
    else:
        assert weights[0] == 404  # vLLM has no such route, token or not
    assert server.adapters == {} and server.version == 0
    listed = call(running.url + "/v1/models")
    assert listed[0] == 200 and [m["id"] for m in listed[1]["data"]] == ["tiny"]


def test_admin_routes_work_with_the_token_and_user_routes_need_none(guarded, tmp_path):
    running, contract = guarded
    make_lora(tmp_path / "adapter")
    server = running.app[SERVER]
    load = {"lora_name": "skill", "lora_path": str(tmp_path / "adapter"), "version": 3}
    status, body, _ = call(running.url + "/v1/load_lora_adapter", load, TOKEN)
    assert status == 200 and "skill" in body and "skill" in server.adapters
    try:
        status, body, _ = call(running.url + "/v1/chat/completions", {"model": "skill", "messages": HELLO,
                                                                     "max_tokens": 2})
        assert status == 200 and body["model"] == "skill"
        replace_in_place = {**load, "load_inplace": True}
        assert_refused(call(running.url + "/v1/load_lora_adapter", replace_in_place), contract)
        assert call(running.url + "/v1/load_lora_adapter", replace_in_place, TOKEN)[0] == 200
    finally:
        status, _, _ = call(running.url + "/v1/unload_lora_adapter", {"lora_name": "skill"}, TOKEN)
    assert status == 200 and server.adapters == {}
    if contract is Contract.DEV:  # the token lets the request through to the handler, which judges the path
        status, body, _ = call(running.url + "/v1/load_weights", {"path": str(tmp_path / "none"), "version": 4}, TOKEN)
        assert status == 400 and "safetensors" in body["error"]["message"] and server.version == 0


def test_without_a_configured_token_the_admin_routes_stay_open(tiny, tmp_path):
    running = ServerThread(create_app(tiny))
    try:
        make_lora(tmp_path / "adapter")
        load = {"lora_name": "open", "lora_path": str(tmp_path / "adapter")}
        assert call(running.url + "/v1/load_lora_adapter", load)[0] == 200
        assert call(running.url + "/v1/unload_lora_adapter", {"lora_name": "open"}, "anything")[0] == 200
    finally:
        running.stop()


def test_the_base_model_answers_to_every_served_name_and_no_adapter_may_take_one(tiny, tmp_path):
    running = ServerThread(create_app(tiny, served_model_names=("calc", "words"), contract=Contract.VLLM))
    try:
        listed = call(running.url + "/v1/models")[1]
        assert [(m["id"], m["parent"]) for m in listed["data"]] == [("calc", None), ("words", None)]
        for name in ("calc", "words"):
            status, body, _ = call(running.url + "/v1/chat/completions",
                                   {"model": name, "messages": HELLO, "max_tokens": 2})
            assert status == 200 and body["model"] == name
        status, body, _ = call(running.url + "/v1/chat/completions", {"model": "tiny", "messages": HELLO})
        assert status == 404 and "`tiny` does not exist" in body["error"]["message"]
        make_lora(tmp_path / "adapter")
        status, body, _ = call(running.url + "/v1/load_lora_adapter",
                               {"lora_name": "words", "lora_path": str(tmp_path / "adapter")})
        assert status == 400 and "base model's name" in body["error"]["message"]
        assert running.app[SERVER].adapters == {}
    finally:
        running.stop()

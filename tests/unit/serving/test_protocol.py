"""The dev model server under ``--contract vllm`` answers as vLLM does: no policy versions, LoRA by name only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from pathlib import Path
from typing import Any

import openai
import pytest
from click.testing import CliRunner

from agentstream.cli import main
from agentstream.infra.config import ConfigError, ServerConfig
from agentstream.models import load_model
from agentstream.schemas.contracts import POLICY_VERSION_HEADER
from agentstream.serving.app import create_app
from agentstream.serving.protocol import Contract
from tests.support.http_thread import ServerThread
from tests.support.servers import HELLO, assert_exact, make_lora

SAMPLED = dict(messages=HELLO, max_tokens=12, seed=5, logprobs=True, extra_body={"return_token_ids": True})


def post(url: str, body: dict[str, Any]) -> tuple[int, Any, Message]:
    """POST JSON with urllib; returns (status, body parsed as JSON where it is JSON, headers), errors too."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, raw, headers = response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as error:
        status, raw, headers = error.code, error.read().decode(), error.headers
    try:
        return status, json.loads(raw), headers
    except json.JSONDecodeError:
        return status, raw, headers


def get(url: str) -> tuple[int, Message]:
    """GET with urllib; returns (status, headers), errors too."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.headers
    except urllib.error.HTTPError as error:
        return error.code, error.headers


def not_found(model: str) -> dict[str, Any]:
    """vLLM's body for a request naming a model it does not serve."""
    return {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": "model",
                      "code": 404}}


def chat_logprobs(choice: Any) -> list[float]:
    """The sampled tokens' logprobs of a chat choice."""
    return [entry.logprob for entry in choice.logprobs.content]


def running(contract: Contract) -> Iterator[ServerThread]:
    """A server on its own tiny model (adapters hook the model, so servers do not share one)."""
    server = ServerThread(create_app(load_model("tiny"), contract=contract))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[ServerThread]:
    yield from running(Contract.VLLM)


@pytest.fixture(scope="module")
def dev_server() -> Iterator[ServerThread]:
    yield from running(Contract.DEV)


def client_of(server: ServerThread) -> openai.OpenAI:
    """The official OpenAI client pointed at a server."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def version_headers(server: ServerThread) -> list[str | None]:
    """X-Policy-Version (None when absent) on a chat, a completion, both streamed, the models, errors and health."""
    client = client_of(server)
    chat = client.chat.completions.with_raw_response.create(model="tiny", **SAMPLED)
    completion = client.completions.with_raw_response.create(model="tiny", prompt="Hi", max_tokens=4, logprobs=1)
    chat_stream = client.chat.completions.with_raw_response.create(model="tiny", stream=True, **SAMPLED)
    assert [chunk for chunk in chat_stream.parse()]
    completion_stream = client.completions.with_raw_response.create(model="tiny", prompt="Hi", max_tokens=4,
                                                                    stream=True)
    assert [chunk for chunk in completion_stream.parse()]
    models = client.models.with_raw_response.list()
    unknown_model = post(server.url + "/v1/chat/completions", {"model": "nope", "messages": HELLO})
    bad_request = post(server.url + "/v1/chat/completions", {"model": "tiny", "messages": []})
    assert (unknown_model[0], bad_request[0]) == (404, 400)
    health = get(server.url + "/health")
    unknown_route = get(server.url + "/v1/nowhere")
    assert (health[0], unknown_route[0]) == (200, 404)
    return [*(raw.headers.get(POLICY_VERSION_HEADER) for raw in (chat, completion, chat_stream, completion_stream,
                                                                  models)),
            *(headers.get(POLICY_VERSION_HEADER) for headers in (unknown_model[2], bad_request[2], health[1],
                                                                 unknown_route[1]))]


def test_vllm_contract_sends_no_policy_version(vllm_server):
    assert version_headers(vllm_server) == [None] * 9


def test_dev_contract_stamps_the_policy_version_everywhere(dev_server):
    assert version_headers(dev_server) == ["0"] * 9


def test_load_weights_exists_only_under_the_dev_contract(vllm_server, dev_server, tmp_path):
    body = {"path": str(tmp_path / "nowhere"), "version": 1}
    status, error, headers = post(vllm_server.url + "/v1/load_weights", body)
    assert status == 404 and error["error"]["code"] == 404 and headers.get(POLICY_VERSION_HEADER) is None
    assert post(dev_server.url + "/v1/load_weights", body)[0] == 400  # the route is there; the folder is not


def test_unknown_model_gets_vllms_404(vllm_server):
    status, body, _ = post(vllm_server.url + "/v1/completions", {"model": "nope", "prompt": "Hi"})
    assert status == 404 and body == not_found("nope")
    with pytest.raises(openai.NotFoundError):
        client_of(vllm_server).chat.completions.create(model="nope", messages=HELLO, max_tokens=2)


def test_adapter_loads_lists_serves_and_unloads_by_name(vllm_server, dev_server, tiny, tmp_path: Path):
    reference = make_lora(tmp_path / "adapter")
    client = client_of(vllm_server)
    load = {"lora_name": "skill", "lora_path": str(tmp_path / "adapter"), "version": "v7"}
    assert post(dev_server.url + "/v1/load_lora_adapter", load)[0] == 400  # the dev contract reads the version ...
    status, text, headers = post(vllm_server.url + "/v1/load_lora_adapter", load)  # ... vLLM ignores it
    assert status == 200 and text == "Success: LoRA adapter 'skill' added successfully."
    assert headers.get(POLICY_VERSION_HEADER) is None
    try:
        models = {model.id: model for model in client.models.list().data}
        assert models["skill"].model_extra["parent"] == "tiny"
        assert models["skill"].model_extra["root"] == str(tmp_path / "adapter")
        assert models["tiny"].model_extra["parent"] is None

        base = client.chat.completions.create(model="tiny", **SAMPLED)
        raw = client.chat.completions.with_raw_response.create(model="skill", **SAMPLED)
        assert raw.headers.get(POLICY_VERSION_HEADER) is None
        adapted = raw.parse()
        assert adapted.model == "skill"
        assert chat_logprobs(adapted.choices[0]) != chat_logprobs(base.choices[0])
        choice = adapted.choices[0]
        assert_exact(tiny, reference, adapted.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                     choice.message.content, chat_logprobs(choice), 1.0)
    finally:
        status, text, _ = post(vllm_server.url + "/v1/unload_lora_adapter", {"lora_name": "skill"})
    assert status == 200 and text == "Success: LoRA adapter 'skill' removed successfully."
    assert "skill" not in {model.id for model in client.models.list().data}
    status, body, headers = post(vllm_server.url + "/v1/chat/completions", {"model": "skill", "messages": HELLO})
    assert status == 404 and body == not_found("skill") and headers.get(POLICY_VERSION_HEADER) is None
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="skill", messages=HELLO, max_tokens=2)
    status, body, _ = post(vllm_server.url + "/v1/unload_lora_adapter", {"lora_name": "skill"})
    assert status == 404 and body["error"]["type"] == "NotFoundError"


def test_serve_model_offers_the_contract_option():
    result = CliRunner().invoke(main, ["serve-model", "--help"])
    assert result.exit_code == 0 and "--contract [dev|vllm]" in result.output
    assert ServerConfig().contract == "dev" and ServerConfig(contract="vllm").contract == "vllm"
    with pytest.raises(ConfigError, match=r"server\.contract"):
        ServerConfig(contract="openai")

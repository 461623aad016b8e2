"""Hostile JSON bodies get a 400 with a reason from every server that parses JSON, never a 500 or a traceback.

Python's ``json`` raises ``RecursionError`` on documents nested some thousands of levels deep; each body
below is sent as raw bytes to the real servers (the proxy with no key configured, as a hostile client
finds it; the dev model server in both contracts; the Schema Registry process), and the log is checked
for tracebacks. The collector gets the same bodies, and spans whose attribute values and dotted keys are
hostile (deep JSON in a string, thousands of dots, an index thousands of digits long).
"""

from __future__ import annotations

import logging

import httpx
import pytest

from agentstream.models import load_model
from agentstream.pipeline.collector.http_front import OtlpHttp
from agentstream.pipeline.collector.receiver import OtlpReceiver
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.serving.app import create_app
from agentstream.serving.protocol import Contract
from tests.support.http_thread import ServerThread

pytestmark = pytest.mark.integration

DEPTH = 200_000
HOSTILE = {
    "arrays nested 200,000 deep": b"[" * DEPTH + b"]" * DEPTH,
    "objects nested 200,000 deep": b'{"a":' * DEPTH + b"1" + b"}" * DEPTH,
    "a chat body with messages nested 200,000 deep": b'{"model": "tiny", "messages": ' + b"[" * DEPTH + b"]" * DEPTH
                                                     + b"}",
    "not UTF-8": b'{"model": "\xff\xfe"}',
    "not an object": b"[1, 2, 3]",
    "not JSON": b'{"model": ',
}
PROXY_ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/completions", "/rollouts/r-1/v1/chat/completions",
                "/rollouts/r-1/reward", "/api/rollouts/r-1/attempt/a-1/events")
SERVER_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def assert_refused(response: httpx.Response, what: str) -> None:
    assert response.status_code == 400, f"{what}: {response.status_code} {response.text[:300]}"
    error = response.json()["error"]
    assert error["message"], what


def assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    failures = [record for record in caplog.records if record.exc_info or "Traceback" in record.getMessage()]
    assert failures == [], [record.getMessage() for record in failures]


@pytest.fixture(scope="module", params=[Contract.DEV, Contract.VLLM], ids=["dev", "vllm"])
def model_server(request):
    running = ServerThread(create_app(load_model("tiny"), contract=request.param))
    yield running
    running.stop()


def test_the_proxy_and_the_model_server_refuse_hostile_json_with_a_reason(model_server, publisher, caplog):
    caplog.set_level(logging.WARNING)
    proxy = ServerThread(LLMProxy(model_server.url, publisher, feedback_secret=None).app)
    try:
        with httpx.Client(timeout=60) as client:
            for name, body in HOSTILE.items():
                for route in PROXY_ROUTES:
                    assert_refused(client.post(proxy.url + route, content=body,
                                               headers={"Content-Type": "application/json"}), f"proxy {route}, {name}")
                for route in SERVER_ROUTES:
                    assert_refused(client.post(model_server.url + route, content=body,
                                               headers={"Content-Type": "application/json"}), f"server {route}, {name}")
            answer = client.post(proxy.url + "/v1/chat/completions",  # and both still answer
                                 json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2})
            assert answer.status_code == 200, answer.text
    finally:
        proxy.stop()
    assert_no_traceback(caplog)


def test_tool_call_arguments_nested_too_deeply_are_text_not_a_crash(model_server, caplog):
    """Arguments are a string the client sends back; one that JSON cannot parse is rendered as it came."""
    caplog.set_level(logging.WARNING)
    arguments = "[" * 1_500 + "]" * 1_500  # deeper than json.loads recurses
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    answer = httpx.post(model_server.url + "/v1/chat/completions", timeout=120,
                        json={"model": "tiny", "messages": messages, "max_tokens": 2})
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["usage"]["prompt_tokens"] > 1_500  # the arguments were in the prompt, as text
    assert_no_traceback(caplog)


def test_the_schema_registry_refuses_hostile_json_with_a_reason(schema_registry):
    with httpx.Client(timeout=60) as client:
        for name, body in HOSTILE.items():
            answer = client.post(f"{schema_registry.url}/subjects/hostile-value/versions", content=body,
                                 headers={"Content-Type": "application/vnd.schemaregistry.v1+json"})
            assert answer.status_code in (400, 422), f"{name}: {answer.status_code} {answer.text[:300]}"
        assert client.get(f"{schema_registry.url}/subjects").status_code == 200
    assert "Traceback" not in schema_registry.log_path.read_text(errors="replace")


def otlp_span(attributes: dict[str, str], number: int) -> dict:
    """One OTLP/JSON export request holding one span with these string attributes."""
    return {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"spans": [{
        "traceId": f"{number:032x}", "spanId": f"{number:016x}", "name": "ChatCompletion", "kind": 3,
        "startTimeUnixNano": "1000", "endTimeUnixNano": "2000",
        "attributes": [{"key": key, "value": {"stringValue": value}} for key, value in attributes.items()]}]}]}]}


def test_the_collector_refuses_hostile_json_and_keeps_spans_with_hostile_attributes(publisher, caplog):
    caplog.set_level(logging.WARNING)
    receiver = OtlpReceiver(publisher)
    collector = ServerThread(OtlpHttp(receiver).app)
    deep = "[" * DEPTH + "]" * DEPTH
    hostile_spans = {
        "deep JSON in llm.invocation_parameters": {"llm.invocation_parameters": deep},
        "deep JSON where token ids go": {"agentstream.prompt_token_ids": deep, "agentstream.response_token_ids": deep,
                                         "agentstream.response_logprobs": deep},
        "a message key with 20,000 dots": {"llm.input_messages.0." + "a." * 20_000 + "content": "hi"},
        "a message index 5,000 digits long": {"llm.input_messages." + "9" * 5_000 + ".message.content": "hi",
                                              "gen_ai.prompt." + "1" * 5_000 + ".content": "hi"},
    }
    url = collector.url + "/v1/traces"
    try:
        with httpx.Client(timeout=60) as client:
            for name, body in HOSTILE.items():
                answer = client.post(url, content=body, headers={"Content-Type": "application/json"})
                assert answer.status_code == 400, f"{name}: {answer.status_code} {answer.text[:300]}"
                assert answer.json()["message"], name
            for number, (name, attributes) in enumerate(hostile_spans.items(), start=1):
                answer = client.post(url, json=otlp_span(attributes, number))
                assert answer.status_code == 200, f"{name}: {answer.status_code} {answer.text[:300]}"
                assert "partialSuccess" not in answer.json() or not answer.json()["partialSuccess"], name
    finally:
        collector.stop()
    assert receiver.stats.spans_received == len(hostile_spans)
    assert receiver.stats.spans_rejected == 0
    assert receiver.stats.requests_refused == len(HOSTILE)
    assert_no_traceback(caplog)

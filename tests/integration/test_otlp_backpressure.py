"""Back-pressure with a real stall: the broker is frozen (SIGSTOP: connections stay open, nothing answers) while the
collector's publisher has a small buffer. Exports that no longer fit get 503 with Retry-After (OTLP/HTTP) or
UNAVAILABLE with a RetryInfo (OTLP/gRPC) at once instead of hanging; the official SDK exporter retries through the
stall; once the broker answers again every span that was taken, and every span retried, lands exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

from agentstream.infra import kafka
from agentstream.infra.kafka import client_options, topic_name
from agentstream.pipeline.collector.grpc_front import serve_grpc
from agentstream.pipeline.collector.http_front import OtlpHttp
from agentstream.pipeline.collector.receiver import OtlpReceiver
from agentstream.pipeline.publisher import SpanPublisher
from tests.support.broker import MemoryBroker
from tests.support.http_thread import ServerThread
from tests.support.readback import read_topic

EXPORTERS = Path(__file__).resolve().parents[1] / "support" / "otel_exporters.py"
BUFFER = 64 * 1024


def export_body(number: int, spans: int = 40) -> tuple[bytes, list[str]]:
    """One trace of `spans` spans with ~1 KB of attributes each: an OTLP protobuf body, and its span ids."""
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    trace_id = number.to_bytes(16, "big")
    ids = []
    for index in range(spans):
        span_id = (number * 1000 + index + 1).to_bytes(8, "big")
        ids.append(span_id.hex())
        span = scope.spans.add(trace_id=trace_id, span_id=span_id, name=f"step {index}",
                               start_time_unix_nano=10**18 + index, end_time_unix_nano=10**18 + index + 1000)
        if index:
            span.parent_span_id = (number * 1000 + 1).to_bytes(8, "big")
        attribute = span.attributes.add(key="input.value")
        attribute.value.string_value = "x" * 1000
    return request.SerializeToString(), ids


def post(url: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url + "/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


@pytest.fixture
def stalled(tmp_path, topics_config):
    """A broker of this test's own, a publisher with a 64 KiB buffer on it, and the collector over that publisher."""
    broker = MemoryBroker(tmp_path / "tansu").start()
    asyncio.run(kafka.create_topics(topics_config, broker.bootstrap_servers))
    publisher = SpanPublisher(topics_config, broker.bootstrap_servers, journal_dir=tmp_path / "journal",
                              max_buffered_bytes=BUFFER, batch_bytes=16 * 1024, request_timeout_ms=60_000).start()
    receiver = OtlpReceiver(publisher)
    http = ServerThread(OtlpHttp(receiver).app)
    grpc_server = http.call(serve_grpc(receiver, "127.0.0.1", 0))
    try:
        yield {"broker": broker, "publisher": publisher, "receiver": receiver, "http": http.url,
               "grpc": grpc_server.port, "kafka": client_options(topics_config.kafka, broker.bootstrap_servers),
               "spans": topic_name(topics_config.topics, "spans")}
    finally:
        broker.process.send_signal(signal.SIGCONT)
        http.call(grpc_server.stop(0))
        http.stop()
        publisher.close(10)
        broker.kill()


def test_a_stalled_broker_gets_503_and_unavailable_with_retry_after_and_loses_nothing(stalled):
    url, publisher, receiver = stalled["http"], stalled["publisher"], stalled["receiver"]
    warm, warm_ids = export_body(1, spans=1)
    assert post(url, warm)[0] == 200
    publisher.flush(10)
    stalled["broker"].process.send_signal(signal.SIGSTOP)

    taken: list[str] = list(warm_ids)
    refused_body: bytes | None = None
    for number in range(2, 12):
        body, ids = export_body(number)
        started = time.monotonic()
        status, headers, answer = post(url, body)
        assert time.monotonic() - started < 5, "a full buffer answers at once, it does not hold the request"
        if status == 200:
            taken += ids
            continue
        assert status == 503, answer
        assert int(headers["Retry-After"]) >= 1
        error = status_pb2.Status.FromString(answer)
        assert error.code == 14 and "cannot take more spans now" in error.message, error.message
        refused_body, refused_ids = body, ids
        break
    assert refused_body is not None, "the 64 KiB buffer never filled"
    assert publisher.stats().buffered_bytes <= BUFFER

    with grpc.insecure_channel(f"127.0.0.1:{stalled['grpc']}") as channel, pytest.raises(grpc.RpcError) as raised:
        TraceServiceStub(channel).Export(ExportTraceServiceRequest.FromString(refused_body), timeout=5)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    retry_info = error_details_pb2.RetryInfo.FromString(dict(raised.value.trailing_metadata())[
        "google.rpc.retryinfo-bin"])
    assert retry_info.retry_delay.seconds >= 1

    # the official exporter, started while the broker is still frozen, gets 503 and retries after Retry-After (its
    # 9 spans of 8 KB are more than the buffer's free room: once the broker answers, the buffer empties and takes them)
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"})
    exporter = subprocess.Popen([sys.executable, str(EXPORTERS), "--traces", "3", "--spans", "3", "--logs", "0",
                                 "--padding", "8000"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    busy_before = receiver.stats.requests_busy
    deadline = time.monotonic() + 30
    while receiver.stats.requests_busy == busy_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.stats.requests_busy > busy_before, "the SDK's export met the full buffer"
    stalled["broker"].process.send_signal(signal.SIGCONT)
    out, err = exporter.communicate(timeout=60)
    assert exporter.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report["results"]["traces"]) == {"SUCCESS"}, report["problems"]
    assert any("retrying" in line for line in report["problems"]), "it was told to retry, and did"

    assert post(url, refused_body)[0] == 200, "the refused export, retried once the broker answers"
    expected = Counter(taken + refused_ids + report["span_ids"])
    publisher.flush(30)
    landed = read_topic(stalled["kafka"], stalled["spans"], lambda found: len(found.spans) >= sum(expected.values()))
    assert Counter(span["span_id"] for span in landed.spans) == expected, \
        "every span taken landed once; nothing of a refused export was taken before its retry"
    stats = publisher.stats()
    assert stats.records_dropped == 0

"""OpenTelemetry in: an instrumented agent (official SDK, OTLP exporter, OpenAI and httpx instrumentations) whose
spans reach the OTLP receiver while its LLM calls go through the proxy; one trajectory in ClickHouse. And
malformed OTLP, over HTTP (a body that claims gzip and is not, too) and gRPC: error responses and dead letters,
never a crash; logs and metrics, protobuf and JSON, answered and counted."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
import zlib
from pathlib import Path

import grpc
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from google.rpc import status_pb2
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.collector.logs.v1.logs_service_pb2_grpc import LogsServiceStub
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import load_config
from agentstream.infra.kafka import client_options, topic_name
from agentstream.models import load_model
from agentstream.pipeline.collector.grpc_front import serve_grpc
from agentstream.pipeline.collector.http_front import OtlpHttp
from agentstream.pipeline.collector.receiver import KafkaDeadLetters, OtlpReceiver
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.schemas import AvroCodec
from agentstream.serving.app import create_app
from tests.support.http_thread import ServerThread
from tests.support.streams_harness import Worker, create_topics, wait_for, worker_env

AGENT = Path(__file__).resolve().parents[1] / "support" / "otel_agent.py"
CONFIG = """
[streams]
app_id = "{app_id}"
grace_s = 0.3
idle_timeout_s = 5
session_timeout_s = 3
"""


@pytest.fixture(scope="module")
def upstream():
    running = ServerThread(create_app(load_model("tiny")))
    yield running
    running.stop()


@pytest.fixture
def otel(tmp_path, stack, stack_config, upstream):
    """A private pipeline: topics, publisher, proxy, OTLP receiver (with its DLQ), a streams worker, ClickHouse."""
    tag = uuid.uuid4().hex[:8]
    database = f"otlp_{tag}"
    env = worker_env(tmp_path, stack, f"o{tag}.", database, CONFIG.format(app_id=f"otlp-{tag}"))
    create_topics(env)
    config = load_config(environ=env)
    publisher = SpanPublisher(config, stack.bootstrap_servers, journal_dir=tmp_path / "journal").start()
    proxy = ServerThread(LLMProxy(upstream.url, publisher).app)
    dlq = topic_name(config.topics, "dlq")
    dead_letters = KafkaDeadLetters(config.kafka, client_options(config.kafka, stack.bootstrap_servers), dlq)
    receiver = OtlpReceiver(publisher, dead_letters)
    collector = ServerThread(OtlpHttp(receiver).app)
    grpc_server = collector.call(serve_grpc(receiver, "127.0.0.1", 0))
    client = connect(stack_config.clickhouse, stack.clickhouse_url)
    try:
        yield {"database": database, "proxy": proxy, "collector": collector, "client": client, "dlq": dlq,
               "grpc": f"127.0.0.1:{grpc_server.port}", "receiver": receiver,
               "kafka": client_options(config.kafka, stack.bootstrap_servers),
               "start_worker": lambda: Worker(env, tmp_path / "worker.log").start()}
    finally:
        collector.call(grpc_server.stop(0))
        collector.stop()
        proxy.stop()
        publisher.close()
        client.command(f"DROP DATABASE IF EXISTS {database}")
        client.close()


def rows(client, sql: str, **parameters) -> list[tuple]:
    return client.query(sql, parameters=parameters).result_rows


def test_instrumented_agent_and_proxy_make_one_trajectory_with_token_ids(otel):
    worker = otel["start_worker"]()
    try:
        env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "OPENAI_"))}
        env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": otel["collector"].url, "OTEL_SERVICE_NAME": "math-service",
                    "OPENAI_BASE_URL": otel["proxy"].url + "/v1", "OPENAI_API_KEY": "unused"})
        ran = subprocess.run([sys.executable, str(AGENT)], env=env, capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr[-3000:]
        trace_id = json.loads(ran.stdout.strip().splitlines()[-1])["trace_id"]
        client, db = otel["client"], otel["database"]
        rollout = wait_for(lambda: rows(
            client, f"SELECT status, agent_name, span_count, llm_calls, llm_calls_without_tokens, final_reward "
                    f"FROM {db}.rollouts FINAL WHERE rollout_id = {{r:String}}", r=trace_id),
            timeout_s=30, what="the rollouts row of the agent's trace")
        assert rollout == [("SUCCEEDED", "otel-math", 6, 2, 1, 1.0)], \
            "the proxy's call counts once (its OpenTelemetry client view is not a second call); the hosted one " \
            "has no token ids"
        found = rows(client, f"SELECT name, span_id, parent_id, kind, length(response_token_ids), "
                             f"attributes['agentstream.source'], attempt_id FROM {db}.spans FINAL "
                             "WHERE rollout_id = {r:String}", r=trace_id)
        (proxied,) = [row for row in found if row[4] > 0]
        spans = {row[0]: row for row in found if row[5] == "otlp"}  # the agent's spans, through OpenTelemetry
        assert len(spans) == 5
        root, tool, client_view = spans["invoke_agent math"], spans["execute_tool lookup"], spans["chat tiny"]
        assert (root[3], tool[3], client_view[3], spans["chat gpt-4o"][3]) == ("AGENT", "TOOL", "LLM", "LLM")
        assert proxied[3] == "LLM" and proxied[5] == "", "the proxy's own span, with token ids"
        assert (proxied[2], client_view[2], tool[2], root[2]) == (client_view[1], root[1], root[1], ""), \
            "parented across processes by traceparent"
        assert {row[6] for row in found} == {f"{trace_id}-1"}
        assert spans["gen_ai.evaluation.result"][3] == "REWARD"
        transitions = rows(client, f"SELECT span_id, length(response_token_ids) FROM {db}.transitions FINAL "
                                   "WHERE rollout_id = {r:String}", r=trace_id)
        assert transitions == [(proxied[1], proxied[4])], "only the call with token ids is trained on"
    finally:
        worker.stop()


def post(url: str, body: bytes, content_type: str, path: str = "/v1/traces", **headers: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url + path, data=body, method="POST",
                                     headers={"Content-Type": content_type, **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def dead_letters(options: dict, topic: str, count: int) -> list[dict]:
    async def read() -> list[dict]:
        codec, found = AvroCodec(), []
        consumer = AIOKafkaConsumer(**options, enable_auto_commit=False)
        await consumer.start()
        try:
            partition = TopicPartition(topic, 0)
            consumer.assign([partition])
            await consumer.seek_to_beginning(partition)
            for _ in range(50):
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    found.extend(codec.decode(record.value)[1] for record in records)
                if len(found) >= count:
                    break
        finally:
            await consumer.stop()
        return found

    return asyncio.run(read())


def test_malformed_otlp_gets_otlp_errors_and_dead_letters(otel):
    url = otel["collector"].url
    status, body = post(url, b"\x0a\xff\xff\xff\xff\x0f not protobuf", "application/x-protobuf")
    assert status == 400
    error = status_pb2.Status.FromString(body)
    assert error.code == 3 and "protobuf" in error.message
    status, body = post(url, b'{"resourceSpans": [', "application/json")
    assert status == 400 and json.loads(body)["code"] == 3
    status, body = post(url, b"spans", "text/plain")
    assert status == 415
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    spans.add(trace_id=bytes(range(1, 17)), span_id=b"\x01" * 8, name="fine", start_time_unix_nano=10**18,
              end_time_unix_nano=10**18 + 1000)
    spans.add(trace_id=b"\x01\x02", span_id=b"\x01" * 8, name="bad ids", start_time_unix_nano=10**18,
              end_time_unix_nano=10**18)
    status, body = post(url, request.SerializeToString(), "application/x-protobuf")
    assert status == 200
    answer = ExportTraceServiceResponse.FromString(body)
    assert answer.partial_success.rejected_spans == 1 and "trace_id" in answer.partial_success.error_message
    status, body = post(url, b'{"resourceSpans": []}', "application/json")
    assert (status, json.loads(body)) == (200, {})
    letters = dead_letters(otel["kafka"], otel["dlq"], 4)
    assert [(letter["source_topic"], letter["error_type"]) for letter in letters] == [
        ("otlp:/v1/traces", "MalformedOtlp")] * 3 + [("otlp:/v1/traces", "RejectedSpan")]
    assert letters[0]["value"].startswith(b"\x0a\xff") and "protobuf" in letters[0]["error"]
    assert letters[2]["value"] == b"spans" and "text/plain" in letters[2]["error"]
    assert json.loads(letters[3]["value"])["name"] == "bad ids"
    with urllib.request.urlopen(url + "/health", timeout=5) as health:
        stats = json.loads(health.read())
    assert (stats["requests_refused"], stats["spans_rejected"], stats["spans_published"]) == (3, 1, 1)


def test_compressed_bodies_logs_metrics_and_grpc_errors(otel):
    url = otel["collector"].url
    traces = ExportTraceServiceRequest()
    traces.resource_spans.add().scope_spans.add().spans.add(
        trace_id=bytes(range(1, 17)), span_id=b"\x02" * 8, name="zipped", start_time_unix_nano=10**18,
        end_time_unix_nano=10**18 + 1000)
    for encoding, compress in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        status, body = post(url, compress(traces.SerializeToString()), "application/x-protobuf",
                            **{"Content-Encoding": encoding})
        assert (status, body) == (200, b""), "inflated once, by the server"
    status, body = post(url, b"plain bytes, not gzip", "application/x-protobuf", **{"Content-Encoding": "gzip"})
    assert status == 400 and "not valid gzip" in status_pb2.Status.FromString(body).message
    status, body = post(url, gzip.compress(b"{}"), "application/json", **{"Content-Encoding": "compress"})
    assert status == 415 and "compress" in json.loads(body)["message"]

    logs = {"resourceLogs": [{"scopeLogs": [{"logRecords": [
        {"timeUnixNano": "1", "body": {"stringValue": "one"}, "traceId": "0102030405060708090a0b0c0d0e0f10",
         "spanId": "0102030405060708"}, {"body": {"stringValue": "two"}}]}]}]}
    status, body = post(url, json.dumps(logs).encode(), "application/json", path="/v1/logs")
    assert (status, json.loads(body)) == (200, {})
    logs["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]["traceId"] = "not hex"
    status, body = post(url, json.dumps(logs).encode(), "application/json", path="/v1/logs")
    assert status == 400 and "not hex" in json.loads(body)["message"]
    metrics = ExportMetricsServiceRequest()
    metric = metrics.resource_metrics.add().scope_metrics.add().metrics.add(name="calls")
    metric.sum.data_points.add(as_int=3)
    metric.sum.data_points.add(as_int=4)
    status, body = post(url, gzip.compress(metrics.SerializeToString()), "application/x-protobuf", path="/v1/metrics",
                        **{"Content-Encoding": "gzip"})
    assert status == 200 and ExportMetricsServiceResponse.FromString(body) == ExportMetricsServiceResponse()

    with grpc.insecure_channel(otel["grpc"]) as channel:
        garbage = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        with pytest.raises(grpc.RpcError) as raised:
            garbage(b"\x0a\xff\xff\xff\xff\x0f not protobuf", timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in raised.value.details()
        answer = LogsServiceStub(channel).Export(ExportLogsServiceRequest(), timeout=10,
                                                 compression=grpc.Compression.Gzip)
        assert answer == ExportLogsServiceResponse()

    letters = dead_letters(otel["kafka"], otel["dlq"], 4)
    assert [(letter["source_topic"], letter["error_type"]) for letter in letters] == [
        ("otlp:/v1/traces", "MalformedOtlp"), ("otlp:/v1/traces", "MalformedOtlp"),
        ("otlp:/v1/logs", "MalformedOtlp"), ("otlp:/v1/traces", "MalformedOtlp")]
    assert "gzip" in letters[0]["error"] and letters[3]["value"].startswith(b"\x0a\xff")
    stats = otel["receiver"].stats
    assert (stats.spans_published, stats.log_records_received, stats.metric_points_received) == (2, 2, 2)
    assert stats.requests_refused == 4

"""The official OpenTelemetry SDK exporters against the collector, configured only as a user would (environment):
OTLP/HTTP protobuf and OTLP/gRPC, without and with gzip, land every span of every trace on the spans topic;
their logs and metrics exports succeed with no error logged; a keyed collector refuses a keyless exporter
and takes a keyed one, on both transports. And `agentstream collector` itself: both transports, its keys,
its exit line, and its refusal to listen beyond loopback without keys."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from agentstream.infra.config import load_config
from agentstream.infra.kafka import client_options, topic_name
from agentstream.infra.processes import free_port, wait_for_port
from agentstream.infra.security import KeySet
from agentstream.pipeline.collector.grpc_front import serve_grpc
from agentstream.pipeline.collector.http_front import OtlpHttp
from agentstream.pipeline.collector.receiver import OtlpReceiver
from tests.support.http_thread import ServerThread
from tests.support.readback import read_topic
from tests.support.streams_harness import create_topics, worker_env

EXPORTERS = Path(__file__).resolve().parents[1] / "support" / "otel_exporters.py"
KEY = "collector-key-1"


@pytest.fixture
def collector(request, publisher):
    """OTLP/HTTP and OTLP/gRPC over one receiver and this test's spans topic; keyed when the test is parametrized so."""
    keys = KeySet(getattr(request, "param", None))
    receiver = OtlpReceiver(publisher, keys=keys)
    http = ServerThread(OtlpHttp(receiver).app)
    grpc = http.call(serve_grpc(receiver, "127.0.0.1", 0))
    try:
        yield {"receiver": receiver, "publisher": publisher, "http": http.url, "grpc": f"http://127.0.0.1:{grpc.port}"}
    finally:
        http.call(grpc.stop(0))
        http.stop()


def export(collector: dict, protocol: str, *, compression: str | None = None, key: str | None = None,
           traces: int = 5, spans: int = 4) -> dict:
    """Run the SDK exporters in a process of their own, configured by OTEL_* variables only; their JSON report."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": collector["grpc" if protocol == "grpc" else "http"],
                "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_SERVICE_NAME": "exporters"})
    if compression is not None:
        env["OTEL_EXPORTER_OTLP_COMPRESSION"] = compression
    if key is not None:
        env["OTEL_EXPORTER_OTLP_HEADERS"] = f"Authorization=Bearer%20{key}"
    ran = subprocess.run([sys.executable, str(EXPORTERS), "--traces", str(traces), "--spans", str(spans)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


def landed_span_ids(collector: dict, kafka_options: dict, topics_config, expected: int) -> Counter:
    collector["publisher"].flush(30)
    topic = topic_name(topics_config.topics, "spans")
    landed = read_topic(kafka_options, topic, lambda found: len(found.spans) >= expected, timeout_s=30)
    return Counter(span["span_id"] for span in landed.spans)


@pytest.mark.parametrize(("protocol", "compression"), [
    ("http/protobuf", None), ("http/protobuf", "gzip"), ("grpc", None), ("grpc", "gzip")])
def test_sdk_exporters_land_every_span_and_export_logs_and_metrics_without_error(
        collector, kafka_options, topics_config, protocol, compression):
    report = export(collector, protocol, compression=compression, traces=20, spans=5)
    assert report["problems"] == [], "the SDK logged no warning or error"
    assert set(report["results"]["traces"]) == {"SUCCESS"}
    assert report["results"]["metrics"] == ["SUCCESS"] and report["results"]["logs"] == ["SUCCESS"]
    assert len(report["span_ids"]) == 100
    assert landed_span_ids(collector, kafka_options, topics_config, 100) == Counter(report["span_ids"]), \
        "every span of the 20 traces, each once"
    stats = collector["receiver"].stats
    assert (stats.spans_published, stats.spans_rejected, stats.requests_refused) == (100, 0, 0)
    assert stats.log_records_received == 3, "logs are accepted and counted"
    assert stats.metric_points_received == 2 + 1, "two counter series and one histogram, counted as data points"


@pytest.mark.parametrize("collector", [f"{KEY},another-key"], indirect=True)
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_keyed_collector_refuses_a_keyless_exporter_and_takes_a_keyed_one(
        collector, kafka_options, topics_config, protocol):
    keyless = export(collector, protocol, traces=2, spans=2)
    assert set(keyless["results"]["traces"]) == {"FAILURE"} and keyless["results"]["logs"] == ["FAILURE"]
    refusal = "401" if protocol != "grpc" else "UNAUTHENTICATED"
    assert any(refusal in line for line in keyless["problems"]), keyless["problems"]
    wrong = export(collector, protocol, key="not-a-key", traces=1, spans=1)
    assert set(wrong["results"]["traces"]) == {"FAILURE"}
    stats = collector["receiver"].stats
    assert stats.spans_published == 0 and stats.log_records_received == 0
    assert stats.requests_unauthorized == 6, "traces, metrics and logs of both refused runs"

    keyed = export(collector, protocol, compression="gzip", key=KEY, traces=3, spans=3)
    assert keyed["problems"] == [] and set(keyed["results"]["traces"]) == {"SUCCESS"}
    assert keyed["results"]["metrics"] == ["SUCCESS"] and keyed["results"]["logs"] == ["SUCCESS"]
    assert landed_span_ids(collector, kafka_options, topics_config, 9) == Counter(keyed["span_ids"]), \
        "only the keyed exporter's spans landed"


def test_the_collector_command_serves_http_and_grpc_behind_its_keys(tmp_path, stack):
    env = worker_env(tmp_path, stack, f"c{uuid.uuid4().hex[:8]}.", "unused")
    create_topics(env)
    ran = subprocess.run([sys.executable, "-m", "agentstream", "collector", "--host", "0.0.0.0"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1 and ran.stderr.count("\n") == 1, ran.stderr
    assert "refusing to serve the OTLP collector on 0.0.0.0 without keys" in ran.stderr

    ports = {"http": free_port(), "grpc": free_port()}
    env.update({"AGENTSTREAM_OTLP_PORT": str(ports["http"]), "AGENTSTREAM_OTLP_GRPC_PORT": str(ports["grpc"]),
                "AGENTSTREAM_COLLECTOR_KEYS": KEY})
    command = subprocess.Popen([sys.executable, "-m", "agentstream", "collector"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        for port in ports.values():
            wait_for_port("127.0.0.1", port, 60, command)
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        keyless = export(urls, "grpc", traces=1, spans=1)
        assert set(keyless["results"]["traces"]) == {"FAILURE"}
        over_grpc = export(urls, "grpc", compression="gzip", key=KEY, traces=2, spans=3)
        over_http = export(urls, "http/protobuf", compression="gzip", key=KEY, traces=2, spans=3)
    finally:
        command.send_signal(signal.SIGTERM)
        output, _ = command.communicate(timeout=60)
    assert command.returncode == 0, output
    for report in (over_grpc, over_http):
        assert report["problems"] == [] and set(report["results"]["traces"]) == {"SUCCESS"}
        assert report["results"]["metrics"] == ["SUCCESS"] and report["results"]["logs"] == ["SUCCESS"]
    assert f"and 127.0.0.1:{ports['grpc']} (OTLP/gRPC)" in output
    assert "12 spans published" in output and "3 without a key" in output, output
    assert "6 log records and 6 metric points accepted, not stored" in output, output
    config = load_config(environ=env)
    expected = Counter(over_grpc["span_ids"] + over_http["span_ids"])
    landed = read_topic(client_options(config.kafka, stack.bootstrap_servers), topic_name(config.topics, "spans"),
                        lambda found: len(found.spans) >= 12)
    assert Counter(span["span_id"] for span in landed.spans) == expected

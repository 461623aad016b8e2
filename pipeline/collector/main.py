"""The `agentstream collector` process: OTLP/HTTP and OTLP/gRPC receivers that publish traces as spans."""

from __future__ import annotations

import uvloop

from agentstream.infra.config import Config
from agentstream.infra.grace import until_signalled
from agentstream.infra.kafka import client_options, topic_name
from agentstream.infra.processes import ServiceError
from agentstream.infra.security import KeySet, check_bind
from agentstream.pipeline.collector.grpc_front import serve_grpc
from agentstream.pipeline.collector.http_front import serve_http
from agentstream.pipeline.collector.receiver import KafkaDeadLetters, OtlpReceiver
from agentstream.pipeline.publisher import process_publisher


def run_collector(config: Config, bootstrap_servers: str, host: str | None = None, port: int | None = None,
                  grpc_port: int | None = None) -> None:
    """Receive OpenTelemetry exports until SIGTERM or SIGINT and publish their traces as spans (None: [otlp]'s)."""
    host = host or config.otlp.host
    port = port or config.otlp.port
    grpc_port = config.otlp.grpc_port if grpc_port is None else grpc_port
    keys = KeySet(config.security.collector_keys)
    check_bind("OTLP collector", host, keys, "collector_keys", config.security)

    async def serve() -> None:
        dead_letters = KafkaDeadLetters(config.kafka, client_options(config.kafka, bootstrap_servers),
                                        topic_name(config.topics, "dlq"))
        with process_publisher(config, bootstrap_servers, "collector") as publisher:
            receiver = OtlpReceiver(publisher, dead_letters, keys=keys, complete_on_root=config.otlp.complete_on_root,
                                    max_body_bytes=config.otlp.max_body_mb << 20)
            try:
                runner = await serve_http(receiver, host, port)
            except OSError as error:
                raise ServiceError(f"the OTLP/HTTP receiver cannot listen on {host}:{port}: {error}") from None
            try:
                grpc = await serve_grpc(receiver, host, grpc_port) if grpc_port else None
            except ServiceError:
                await runner.cleanup()
                raise
            keyed = " (keys required: OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<key>)" if keys else ""
            print(f"collector on http://{host}:{port} (OTLP/HTTP: /v1/traces, /v1/logs, /v1/metrics)"
                  + (f" and {host}:{grpc_port} (OTLP/gRPC)" if grpc else "") + f"{keyed}; export with "
                  f"OTEL_EXPORTER_OTLP_ENDPOINT=http://{host}:{port}"
                  + (f", or http://{host}:{grpc_port} and OTEL_EXPORTER_OTLP_PROTOCOL=grpc" if grpc else ""),
                  flush=True)
            try:
                await until_signalled()
            finally:
                if grpc is not None:
                    await grpc.stop()
                await runner.cleanup()
                stats = receiver.stats
                print(f"collector: {stats.spans_published} spans published, {stats.spans_rejected} refused, "
                      f"{stats.requests_refused} requests refused, {stats.requests_busy} answered 'retry later', "
                      f"{stats.requests_unauthorized} without a key, {stats.analytics_only_llm_spans} LLM spans "
                      f"without token ids (analytics only); {stats.log_records_received} log records and "
                      f"{stats.metric_points_received} metric points accepted, not stored", flush=True)

    uvloop.run(serve())

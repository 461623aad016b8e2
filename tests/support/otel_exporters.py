"""The official OpenTelemetry SDK exporters of all three signals, configured only by environment, as a user runs them.

``OTEL_EXPORTER_OTLP_PROTOCOL`` picks the exporters (``grpc`` or ``http/protobuf``, as the SDK's own
auto-configuration does); ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_COMPRESSION`` and
``OTEL_EXPORTER_OTLP_HEADERS`` are read by the exporters themselves. It records ``--traces`` traces of
``--spans`` spans (each with ``--padding`` bytes of ``input.value``), a counter and a histogram, and
``--logs`` log records, shuts the providers down (which exports everything), and prints JSON: the
trace and span ids, each exporter's export results, and every warning or error the OpenTelemetry
libraries logged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


class Problems(logging.Handler):
    """Keeps what the OpenTelemetry libraries log at WARNING and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def exporters() -> tuple[Any, Any, Any]:
    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter  # type: ignore[assignment]
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
            OTLPMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    return OTLPSpanExporter(), OTLPMetricExporter(), OTLPLogExporter()


def recorded(exporter: Any, results: list[str]) -> Any:
    """The exporter, with the result of each of its exports appended to `results`."""
    export = exporter.export

    def recording(*args: Any, **kwargs: Any) -> Any:
        result = export(*args, **kwargs)
        results.append(result.name)
        return result

    exporter.export = recording
    return exporter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--traces", type=int, default=5)
    parser.add_argument("--spans", type=int, default=4, help="spans per trace (a root and its children)")
    parser.add_argument("--logs", type=int, default=3)
    parser.add_argument("--padding", type=int, default=0, help="bytes of an input.value attribute on every span")
    args = parser.parse_args()
    problems = Problems()
    logging.getLogger("opentelemetry").addHandler(problems)
    results: dict[str, list[str]] = {"traces": [], "metrics": [], "logs": []}
    span_exporter, metric_exporter, log_exporter = exporters()

    tracing = TracerProvider()
    tracing.add_span_processor(BatchSpanProcessor(recorded(span_exporter, results["traces"])))
    metering = MeterProvider(metric_readers=[PeriodicExportingMetricReader(
        recorded(metric_exporter, results["metrics"]), export_interval_millis=60_000)])
    logging_provider = LoggerProvider()
    logging_provider.add_log_record_processor(BatchLogRecordProcessor(recorded(log_exporter, results["logs"])))
    app_log = logging.getLogger("otel-exporters-app")
    app_log.propagate = False
    app_log.addHandler(LoggingHandler(logger_provider=logging_provider))
    app_log.setLevel(logging.INFO)

    tracer = tracing.get_tracer("otel-exporters")
    meter = metering.get_meter("otel-exporters")
    calls, latency = meter.create_counter("agent.calls"), meter.create_histogram("agent.latency_ms")
    trace_ids, span_ids = [], []
    padding = {"input.value": "x" * args.padding} if args.padding else {}
    for number in range(args.traces):
        with tracer.start_as_current_span("invoke_agent exporters", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "exporters", **padding}) as root:
            trace_ids.append(format(root.get_span_context().trace_id, "032x"))
            span_ids.append(format(root.get_span_context().span_id, "016x"))
            for child in range(args.spans - 1):
                attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": f"step{child}", **padding}
                with tracer.start_as_current_span(f"execute_tool step{child}", attributes=attributes) as span:
                    span_ids.append(format(span.get_span_context().span_id, "016x"))
            calls.add(1, {"trace": number % 2})
            latency.record(10.0 + number)
    for number in range(args.logs):
        app_log.info("log record %d", number)
    for provider in (tracing, metering, logging_provider):
        provider.shutdown()  # each exports what it holds
    print(json.dumps({"trace_ids": trace_ids, "span_ids": span_ids, "results": results,
                      "problems": problems.lines}), flush=True)


if __name__ == "__main__":
    main()

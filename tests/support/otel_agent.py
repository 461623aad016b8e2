"""An agent as an OpenTelemetry user writes one: the plain OpenAI SDK, the official instrumentation, no agentstream.

Configured the standard way, by environment: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the collector),
``OTEL_SERVICE_NAME``, ``OPENAI_BASE_URL`` (the proxy) and ``OPENAI_API_KEY``. It answers one
question through the proxy, calls a tool, records a hosted model's call it only sees through
OpenTelemetry (no token ids), scores itself with a ``gen_ai.evaluation.result`` event, and prints
its trace id and the response id as JSON.
"""

from __future__ import annotations

import json

import openai
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def main() -> None:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    OpenAIInstrumentor().instrument()
    tracer = trace.get_tracer("otel-agent")
    # W3C traceparent/baggage on every request the SDK sends (OpenTelemetry's own propagator; the openai SDK's
    # HTTP client is httpx2 from openai 3 on, which opentelemetry-instrumentation-httpx does not patch).
    http = openai.DefaultHttpxClient(event_hooks={"request": [lambda request: propagate.inject(request.headers)]})
    client = openai.OpenAI(max_retries=0, http_client=http)
    with tracer.start_as_current_span("invoke_agent math", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "otel-math"}) as root:
        with tracer.start_as_current_span("execute_tool lookup", attributes={
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup"}):
            pass
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+2?"}],
                                                max_tokens=8, temperature=1.0)
        with tracer.start_as_current_span("chat gpt-4o", kind=trace.SpanKind.CLIENT, attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o",
                "gen_ai.usage.input_tokens": 10, "gen_ai.usage.output_tokens": 4}):
            pass  # a hosted model's call: seen through OpenTelemetry only, so no token ids
        root.add_event("gen_ai.evaluation.result", {"gen_ai.evaluation.name": "correctness",
                                                    "gen_ai.evaluation.score.value": 1.0})
        trace_id = format(root.get_span_context().trace_id, "032x")
    provider.shutdown()  # flushes the batch to the collector
    print(json.dumps({"trace_id": trace_id, "response_id": answer.id}), flush=True)


if __name__ == "__main__":
    main()

"""The OTLP receiver behind ``agentstream collector``, shared by its OTLP/HTTP and OTLP/gRPC fronts.

What the OpenTelemetry SDKs and the Collector send, as they send it (:mod:`.http_front`: ``POST /v1/traces``,
``/v1/logs``, ``/v1/metrics``, protobuf or JSON, gzip; :mod:`.grpc_front`: TraceService, LogsService and
MetricsService, gzip too):

* **traces** become Span records on the spans topic (:mod:`agentstream.pipeline.collector.mapping` says what each OTel
  span becomes), handed to the span publisher, which batches them per rollout and journals them on
  local disk while the broker is away: a success means "taken", not "in ClickHouse".
* **logs and metrics** are decoded, counted (``/health``, the collector's exit line) and answered,
  not stored: agentstream keeps traces only. An SDK pointed at the collector with
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` sends all three signals and gets no error for any.

Answers follow the OTLP specification on both transports: success with the signal's
``Export*ServiceResponse`` (``partial_success`` counts the spans refused and says why); a body that
does not decode, 400 / INVALID_ARGUMENT with a ``google.rpc.Status`` saying why; no key of
``[security] collector_keys``, 401 / UNAUTHENTICATED; and back-pressure, while the publisher's
buffer toward the broker is full, 503 with ``Retry-After`` / UNAVAILABLE with a ``RetryInfo`` (both
retried by the SDK exporters). A request's spans are taken all together or not at all, so a retry
never duplicates what was taken. Every refused body or span also goes to the dlq topic as a
DeadLetter record; the receiver never crashes on what it is sent.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from agentstream.infra.config import KafkaConfig
from agentstream.infra.kafka import start_producer
from agentstream.infra.security import KeySet
from agentstream.pipeline.collector.mapping import Mapped, TraceMapper
from agentstream.pipeline.publisher import PublisherClosed, PublisherFull
from agentstream.pipeline.sdk import now_us
from agentstream.schemas import DEAD_LETTER, AvroCodec, EncodeError
from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.json_body import NotJson, json_value
from agentstream.schemas.records import RolloutEventRecord, SpanRecord

log = logging.getLogger("agentstream.otlp")

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
MAX_DEAD_LETTER_BYTES = 512 * 1024  # a dead letter keeps at most this much of a refused body
RETRY_AFTER_S = 1  # what a refused-for-now exporter is told to wait: the publisher drains a full buffer in about that
# google.rpc.Code values used in the error bodies
INVALID_ARGUMENT, UNAVAILABLE, UNAUTHENTICATED = 3, 14, 16


@dataclass(frozen=True)
class Signal:
    """One OTLP signal: its HTTP path, its gRPC service, and its request and response messages."""

    name: str
    request: type[Message]
    response: type[Message]
    service: str

    @property
    def path(self) -> str:
        return f"/v1/{self.name}"

    @property
    def source(self) -> str:
        """The ``source_topic`` of its dead letters."""
        return f"otlp:{self.path}"


def _service(module: Any, name: str) -> str:
    return str(module.DESCRIPTOR.services_by_name[name].full_name)


TRACES = Signal("traces", ExportTraceServiceRequest, ExportTraceServiceResponse,
                _service(trace_service_pb2, "TraceService"))
LOGS = Signal("logs", logs_service_pb2.ExportLogsServiceRequest, logs_service_pb2.ExportLogsServiceResponse,
              _service(logs_service_pb2, "LogsService"))
METRICS = Signal("metrics", metrics_service_pb2.ExportMetricsServiceRequest,
                 metrics_service_pb2.ExportMetricsServiceResponse, _service(metrics_service_pb2, "MetricsService"))
SIGNALS = (TRACES, LOGS, METRICS)


class SpanSink(Protocol):
    def offer(self, spans: Sequence[SpanRecord], events: Sequence[RolloutEventRecord] = ()
              ) -> list[tuple[SpanRecord, EncodeError]]: ...


class DeadLetterSink(Protocol):
    async def send(self, value: bytes) -> None: ...


class KafkaDeadLetters:
    """Writes DeadLetter records to the dlq topic with its own producer (the span publisher writes one topic)."""

    def __init__(self, kafka: KafkaConfig, options: dict[str, Any], topic: str) -> None:
        self.kafka, self.options, self.topic = kafka, options, topic
        self.producer: Any = None

    async def start(self) -> None:
        try:
            self.producer = await start_producer(self.kafka, self.options, request_timeout_ms=10_000)
        except Exception as error:  # the receiver serves without a DLQ rather than not at all
            log.error("dead letters cannot reach the broker (%s): refused OTLP bodies are only logged", error)
            self.producer = None

    async def send(self, value: bytes) -> None:
        if self.producer is None:
            raise ConnectionError("no dead-letter producer")
        await self.producer.send_and_wait(self.topic, value)

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()


@dataclass
class ReceiverStats:
    requests: int = 0
    spans_received: int = 0
    spans_published: int = 0
    spans_rejected: int = 0
    log_records_received: int = 0
    """Accepted and counted, not stored (agentstream keeps traces only)."""
    metric_points_received: int = 0
    """Data points of every metric kind, accepted and counted, not stored."""
    requests_refused: int = 0
    """Bodies that did not decode, too large, or of another media type or encoding."""
    requests_busy: int = 0
    """Answered "retry later" (503 / UNAVAILABLE): the publisher's buffer was full."""
    requests_unauthorized: int = 0
    analytics_only_llm_spans: int = 0
    dead_letters: int = 0
    dead_letters_failed: int = 0


class Refused(AgentstreamError):
    """A request refused as a whole: the HTTP status and the message for its google.rpc.Status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Busy(AgentstreamError):
    """The request cannot be taken now (back-pressure): none of it was taken; a retry after `retry_after_s` may be."""

    retriable = True

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def status_protobuf(code: int, message: str) -> bytes:
    """A ``google.rpc.Status`` (code = 1, message = 2) in protobuf, written by hand: two fields need no library."""
    encoded = message.encode()
    return b"\x08" + _varint(code) + b"\x12" + _varint(len(encoded)) + encoded


def retry_info_protobuf(seconds: int) -> bytes:
    """A ``google.rpc.RetryInfo`` (retry_delay = 1, a Duration with seconds = 1) in protobuf, written by hand."""
    duration = b"\x08" + _varint(seconds)
    return b"\x0a" + _varint(len(duration)) + duration


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})


def _hex_ids_to_base64(document: Any) -> None:
    """OTLP/JSON writes trace and span ids as hex (spans, links, log records, exemplars); protobuf's JSON reads base64.

    Only protobuf field names are object keys in OTLP/JSON (attributes are ``{"key", "value"}`` lists), so
    every id field is found by walking the whole document, without recursion.
    """
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in ID_FIELDS and isinstance(value, str):
                if value:
                    try:
                        node[key] = base64.b64encode(bytes.fromhex(value)).decode()
                    except ValueError:
                        raise Refused(400, f"{key} {value[:64]!r} is not hex (OTLP/JSON ids are hex)") from None
            elif isinstance(value, (dict, list)):
                stack.append(value)


def decode_request(body: bytes, encoding: str, kind: type[Message] = ExportTraceServiceRequest) -> Any:
    """An OTLP export request (of `kind`) from a protobuf or JSON body; raises Refused(400) with the reason."""
    request = kind()
    if encoding == PROTOBUF:
        try:
            request.ParseFromString(body)
        except (DecodeError, ValueError, RuntimeError) as error:
            raise Refused(400, f"the body is not an OTLP {kind.__name__} in protobuf: {error}") from None
        return request
    try:
        document = json_value(body)
    except NotJson as error:
        raise Refused(400, str(error)) from None
    if not isinstance(document, dict):
        raise Refused(400, f"an OTLP/JSON {kind.__name__} is a JSON object")
    _hex_ids_to_base64(document)
    try:
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as error:
        raise Refused(400, f"the body is not an OTLP {kind.__name__} in JSON: {error}") from None
    return request


def log_records(request: logs_service_pb2.ExportLogsServiceRequest) -> int:
    return sum(len(scope.log_records) for resource in request.resource_logs for scope in resource.scope_logs)


def metric_points(request: metrics_service_pb2.ExportMetricsServiceRequest) -> int:
    """Data points of every kind (gauge, sum, histogram, exponential histogram, summary) in the request."""
    total = 0
    for resource in request.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                data = metric.WhichOneof("data")
                if data is not None:
                    total += len(getattr(metric, data).data_points)
    return total


class OtlpReceiver:
    """What both fronts call: checks keys, maps and publishes traces, counts logs and metrics, writes dead letters."""

    def __init__(self, spans: SpanSink, dead_letters: DeadLetterSink | None = None, *, keys: KeySet | None = None,
                 complete_on_root: bool = True, max_body_bytes: int = 32 << 20,
                 retry_after_s: int = RETRY_AFTER_S) -> None:
        self.spans = spans
        self.dead_letters = dead_letters
        self.keys = keys if keys is not None else KeySet(None)
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self.mapper = TraceMapper(complete_on_root=complete_on_root)
        self.codec = AvroCodec()
        self.stats = ReceiverStats()
        self._busy_since: int | None = None  # requests_busy when the current stretch of "retry later" began

    def authorized(self, headers: Mapping[str, str]) -> bool:
        """Whether a request with these headers (or gRPC metadata) may export: no keys set, or it presents one."""
        if self.keys.allows(headers):
            return True
        self.stats.requests_unauthorized += 1
        return False

    async def export(self, signal: Signal, request: Any) -> Message:
        """Take one decoded export request; its response message. Raises Busy (nothing taken) under back-pressure."""
        if signal is TRACES:
            return await self._traces(request)
        if signal is LOGS:
            self.stats.log_records_received += log_records(request)
        else:
            self.stats.metric_points_received += metric_points(request)
        return signal.response()

    async def refuse(self, signal: Signal, refused: Refused, body: bytes, peer: str | None) -> None:
        """Count and log a request refused as a whole, and keep its body as a dead letter."""
        self.stats.requests_refused += 1
        log.warning("refused an OTLP %s request from %s: %s", signal.name, peer, refused)
        await self._dead_letter(signal, body, str(refused), "MalformedOtlp")

    async def _traces(self, request: ExportTraceServiceRequest) -> ExportTraceServiceResponse:
        mapped = self.mapper.map(request, now_us())
        received = len(mapped.spans) + len(mapped.rejected)
        try:
            unfit = self.spans.offer(mapped.spans, mapped.events)
        except (PublisherFull, PublisherClosed) as error:
            raise self._busy(error) from None
        if self._busy_since is not None:
            log.warning("taking spans again, after %d requests answered 'retry later'",
                        self.stats.requests_busy - self._busy_since)
            self._busy_since = None
        self._count(mapped, unfit, received)
        response = ExportTraceServiceResponse()
        if mapped.rejected:
            self.stats.spans_rejected += len(mapped.rejected)
            response.partial_success.rejected_spans = len(mapped.rejected)
            reasons = sorted({reason for reason, _ in mapped.rejected})
            response.partial_success.error_message = "; ".join(reasons)[:2000]
            for reason, span in mapped.rejected:
                await self._dead_letter(TRACES, json.dumps(span, default=str).encode(), reason, "RejectedSpan")
        return response

    def _busy(self, error: PublisherFull | PublisherClosed) -> Busy:
        self.stats.requests_busy += 1
        if isinstance(error, PublisherClosed):
            return Busy("the collector is shutting down: export to another one, or retry", self.retry_after_s)
        if self._busy_since is None:
            self._busy_since = self.stats.requests_busy - 1
            log.warning("answering 'retry later' to trace exports: %s", error)
        return Busy(f"the collector cannot take more spans now ({error}); retry after {self.retry_after_s}s",
                    self.retry_after_s)

    def _count(self, mapped: Mapped, unfit: list[tuple[SpanRecord, EncodeError]], received: int) -> None:
        for span, error in unfit:
            mapped.rejected.append((f"span {span.get('name')!r} does not fit the Span schema: {error}",
                                    {key: value for key, value in span.items() if key != "attributes"}))
        self.stats.spans_received += received
        self.stats.spans_published += len(mapped.spans) - len(unfit)
        self.stats.analytics_only_llm_spans += mapped.analytics_only_llm

    async def _dead_letter(self, signal: Signal, value: bytes, reason: str, error_type: str) -> None:
        if self.dead_letters is None:
            return
        if len(value) > MAX_DEAD_LETTER_BYTES:
            reason = f"{reason} (body truncated from {len(value)} bytes)"
            value = value[:MAX_DEAD_LETTER_BYTES]
        record = self.codec.encode(DEAD_LETTER, {"source_topic": signal.source, "partition": -1, "offset": -1,
                                                 "key": None, "value": value, "error": reason,
                                                 "error_type": error_type, "at_us": now_us()})
        try:
            await self.dead_letters.send(record)
            self.stats.dead_letters += 1
        except Exception as error:  # a broken DLQ must not break the receiver
            self.stats.dead_letters_failed += 1
            log.error("could not write a dead letter (%s): %s", reason, error)


__all__ = ["LOGS", "METRICS", "SIGNALS", "TRACES", "Busy", "KafkaDeadLetters", "OtlpReceiver", "Refused", "Signal",
           "decode_request", "retry_info_protobuf", "status_protobuf"]

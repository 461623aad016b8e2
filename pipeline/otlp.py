"""The OTLP/HTTP trace receiver: ``POST /v1/traces`` (protobuf or JSON) → Span records on the spans topic.

OpenTelemetry exporters point at it unchanged (``OTEL_EXPORTER_OTLP_ENDPOINT=http://host:4318``);
:mod:`pipeline.otlp_map` says what each OTel span becomes. Responses follow the OTLP/HTTP
specification: 200 with an ``ExportTraceServiceResponse`` in the request's encoding (its
``partial_success`` counts the spans refused and says why), 400 with a ``google.rpc.Status`` for a
body that does not decode, 413 for one over the size limit, 415 for another media type or
content encoding. Every refusal also goes to the dlq topic as a DeadLetter record (the body, or
the refused span as JSON, and the reason); the receiver never crashes on what it is sent.

Spans are handed to the span publisher, which batches them per rollout and journals them on
local disk while the broker is away, so the 200 means "taken", not "in ClickHouse".
"""

from __future__ import annotations

import base64
import gzip
import json
import logging
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from pipeline.otlp_map import Mapped, TraceMapper
from pipeline.sdk import now_us
from schemas import DEAD_LETTER, AvroCodec, EncodeError

log = logging.getLogger("agentstream.otlp")

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
SOURCE = "otlp:/v1/traces"
MAX_DEAD_LETTER_BYTES = 512 * 1024  # a dead letter keeps at most this much of a refused body
INVALID_ARGUMENT = 3  # google.rpc.Code


class SpanSink(Protocol):
    async def publish_async(self, span: dict[str, Any]) -> None: ...

    def publish_event(self, event: dict[str, Any]) -> None: ...


class DeadLetterSink(Protocol):
    async def send(self, value: bytes) -> None: ...


class KafkaDeadLetters:
    """Writes DeadLetter records to the dlq topic with its own producer (the span publisher writes one topic)."""

    def __init__(self, options: dict[str, Any], topic: str) -> None:
        self.options, self.topic = options, topic
        self.producer: Any = None

    async def start(self) -> None:
        from aiokafka import AIOKafkaProducer

        self.producer = AIOKafkaProducer(**self.options, acks="all", request_timeout_ms=10_000)
        try:
            await self.producer.start()
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
    requests_refused: int = 0
    analytics_only_llm_spans: int = 0
    dead_letters: int = 0
    dead_letters_failed: int = 0


class Refused(Exception):
    """A request refused as a whole: the HTTP status and the message for its google.rpc.Status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def status_protobuf(code: int, message: str) -> bytes:
    """A ``google.rpc.Status`` (code = 1, message = 2) in protobuf, written by hand: two fields need no library."""
    encoded = message.encode()
    return b"\x08" + _varint(code) + b"\x12" + _varint(len(encoded)) + encoded


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


ID_FIELDS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


def _hex_ids_to_base64(document: Any) -> None:
    """OTLP/JSON writes trace and span ids as hex; protobuf's JSON mapping reads bytes as base64."""
    for resource_spans in _list(document, "resourceSpans", "resource_spans"):
        for scope_spans in _list(resource_spans, "scopeSpans", "scope_spans"):
            for span in _list(scope_spans, "spans"):
                for item in (span, *_list(span, "links")):
                    if not isinstance(item, dict):
                        continue
                    for key in ID_FIELDS:
                        value = item.get(key)
                        if isinstance(value, str) and value:
                            try:
                                item[key] = base64.b64encode(bytes.fromhex(value)).decode()
                            except ValueError:
                                raise Refused(400, f"{key} {value[:64]!r} is not hex (OTLP/JSON ids are hex)") \
                                    from None


def _list(node: Any, *keys: str) -> list[Any]:
    if not isinstance(node, dict):
        return []
    for key in keys:
        value = node.get(key)
        if isinstance(value, list):
            return value
    return []


def decode_request(body: bytes, encoding: str) -> ExportTraceServiceRequest:
    """An ExportTraceServiceRequest from an OTLP/HTTP body; raises Refused(400) with the reason."""
    request = ExportTraceServiceRequest()
    if encoding == PROTOBUF:
        try:
            request.ParseFromString(body)
        except (DecodeError, ValueError, RuntimeError) as error:
            raise Refused(400, f"the body is not an OTLP ExportTraceServiceRequest in protobuf: {error}") from None
        return request
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise Refused(400, f"the body is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise Refused(400, "an OTLP/JSON body is an object with resourceSpans")
    _hex_ids_to_base64(document)
    try:
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as error:
        raise Refused(400, f"the body is not an OTLP ExportTraceServiceRequest in JSON: {error}") from None
    return request


def _media(request: web.Request) -> str:
    media = request.content_type.lower()
    if media == PROTOBUF or media == "application/protobuf":
        return PROTOBUF
    if media == JSON:
        return JSON
    raise Refused(415, f"Content-Type must be {PROTOBUF} or {JSON}, got {request.content_type!r}")


def _inflate(body: bytes, content_encoding: str) -> bytes:
    encoding = content_encoding.lower().strip()
    try:
        if encoding in ("", "identity"):
            return body
        if encoding == "gzip":
            return gzip.decompress(body)
        if encoding == "deflate":
            return zlib.decompress(body)
    except (OSError, EOFError, zlib.error) as error:
        raise Refused(400, f"the body is not valid {encoding}: {error}") from None
    raise Refused(415, f"Content-Encoding {content_encoding!r} is not supported (gzip, deflate or none)")


class OtlpReceiver:
    """The aiohttp application: ``POST /v1/traces``, ``GET /health`` (counters as JSON)."""

    def __init__(self, spans: SpanSink, dead_letters: DeadLetterSink | None = None, *, complete_on_root: bool = True,
                 max_body_bytes: int = 32 << 20) -> None:
        self.spans = spans
        self.dead_letters = dead_letters
        self.mapper = TraceMapper(complete_on_root=complete_on_root)
        self.codec = AvroCodec()
        self.stats = ReceiverStats()
        self.app = web.Application(client_max_size=max_body_bytes)
        self.app.router.add_post("/v1/traces", self.traces)
        self.app.router.add_get("/health", self.health)
        if isinstance(dead_letters, KafkaDeadLetters):  # its producer lives on the loop that serves the app
            self.app.on_startup.append(self._start_dead_letters)
            self.app.on_cleanup.append(self._stop_dead_letters)

    async def _start_dead_letters(self, app: web.Application) -> None:
        assert isinstance(self.dead_letters, KafkaDeadLetters)
        await self.dead_letters.start()

    async def _stop_dead_letters(self, app: web.Application) -> None:
        assert isinstance(self.dead_letters, KafkaDeadLetters)
        await self.dead_letters.stop()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.stats.__dict__})

    async def traces(self, request: web.Request) -> web.Response:
        self.stats.requests += 1
        encoding = JSON
        body = b""
        try:
            try:
                body = await request.read()  # before the media check, so a refused body is kept as its dead letter
            except web.HTTPRequestEntityTooLarge as error:
                raise Refused(413, f"the body is larger than {request.app._client_max_size} bytes") from error
            encoding = _media(request)
            decoded = decode_request(_inflate(body, request.headers.get("Content-Encoding", "")), encoding)
        except Refused as refused:
            return await self._refuse(refused, body, encoding, request)
        mapped = self.mapper.map(decoded, now_us())
        received = len(mapped.spans) + len(mapped.rejected)
        await self._publish(mapped)
        self.stats.spans_received += received
        self.stats.analytics_only_llm_spans += mapped.analytics_only_llm
        response = ExportTraceServiceResponse()
        if mapped.rejected:
            self.stats.spans_rejected += len(mapped.rejected)
            response.partial_success.rejected_spans = len(mapped.rejected)
            reasons = sorted({reason for reason, _ in mapped.rejected})
            response.partial_success.error_message = "; ".join(reasons)[:2000]
            for reason, span in mapped.rejected:
                await self._dead_letter(json.dumps(span, default=str).encode(), reason, "RejectedSpan")
        return self._answer(200, response, encoding)

    async def _publish(self, mapped: Mapped) -> None:
        kept = []
        for span in mapped.spans:
            try:
                await self.spans.publish_async(span)
            except EncodeError as error:
                mapped.rejected.append((f"span {span.get('name')!r} does not fit the Span schema: {error}",
                                        {key: value for key, value in span.items() if key != "attributes"}))
                continue
            kept.append(span)
        self.stats.spans_published += len(kept)
        for event in mapped.events:
            self.spans.publish_event(event)

    async def _refuse(self, refused: Refused, body: bytes, encoding: str, request: web.Request) -> web.Response:
        self.stats.requests_refused += 1
        log.warning("refused an OTLP request from %s: %s", request.remote, refused)
        await self._dead_letter(body, str(refused), "MalformedOtlp")
        message = str(refused)
        if encoding == PROTOBUF:
            return web.Response(status=refused.status, body=status_protobuf(INVALID_ARGUMENT, message),
                                content_type=PROTOBUF)
        return web.json_response({"code": INVALID_ARGUMENT, "message": message}, status=refused.status)

    async def _dead_letter(self, value: bytes, reason: str, error_type: str) -> None:
        if self.dead_letters is None:
            return
        if len(value) > MAX_DEAD_LETTER_BYTES:
            reason = f"{reason} (body truncated from {len(value)} bytes)"
            value = value[:MAX_DEAD_LETTER_BYTES]
        record = self.codec.encode(DEAD_LETTER, {"source_topic": SOURCE, "partition": -1, "offset": -1, "key": None,
                                                 "value": value, "error": reason, "error_type": error_type,
                                                 "at_us": now_us()})
        try:
            await self.dead_letters.send(record)
            self.stats.dead_letters += 1
        except Exception as error:  # a broken DLQ must not break the receiver
            self.stats.dead_letters_failed += 1
            log.error("could not write a dead letter (%s): %s", reason, error)

    @staticmethod
    def _answer(status: int, response: ExportTraceServiceResponse, encoding: str) -> web.Response:
        if encoding == PROTOBUF:
            return web.Response(status=status, body=response.SerializeToString(), content_type=PROTOBUF)
        return web.json_response(json_format.MessageToDict(response), status=status)


async def serve_receiver(receiver: OtlpReceiver, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(receiver.app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner


__all__ = ["KafkaDeadLetters", "OtlpReceiver", "Refused", "decode_request", "serve_receiver", "status_protobuf"]
